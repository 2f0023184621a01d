"""`python -m mhar_lit COMMAND ...`: LightningCLI (fit / validate / test / predict) plus the package's own tools.

Every command parses with jsonargparse, as LightningCLI does (mhar_lit.command_line): `--flag_name value`
(a tool's hyphenated spellings are accepted too), `--help` on every command, `python -m mhar_lit --help`
lists them. lm_eval alone takes lm-evaluation-harness's own flags. A mistake in what was given (a flag, a
key, a value, a path, a checkpoint) prints one line `error: ...`, with the close matches of an unknown key,
and exits 2 from every command; `--debug` anywhere on the command line (or MHAR_DEBUG=1) shows the traceback
instead. Passwords in URIs are replaced by `***` in whatever is printed, tracebacks included.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import warnings
from typing import Optional

from mhar_lit.errors import UserError, UserFileNotFoundError, debug_enabled, report_user_error
from mhar_lit.tracking import DEFAULT_EXPERIMENT, DEFAULT_TRACKING_URI, redact_credentials, run_name_method

PROG = "python -m mhar_lit"

# Lightning's subcommands, run by build_cli.
LIGHTNING_COMMANDS = {
    "fit": "train a model (an MLflow run in ./mlflow.db by default; --ckpt_path resumes)",
    "validate": "validation loss of a checkpoint on the held-out split",
    "test": "test/loss and test/ppl of a checkpoint on the held-out split",
    "predict": "per-sequence loss of a checkpoint on the held-out split",
}
# The package's own tools: name -> (module:function taking argv and returning an exit code, one-line summary).
# A new command is one line here.
TOOLS = {
    "sweep": ("mhar_lit.sweep:sweep_main", "run a grid of fit settings, one MLflow run each"),
    "compare": ("mhar_lit.sweep:compare_main", "table of a sweep's runs with paired deltas against the baseline"),
    "probe": ("mhar_lit.analysis.probe:probe_main", "routing analysis (query probe) of a trained checkpoint"),
    "convert": ("mhar_lit.convert:convert_main", "graft a strategy onto a Hugging Face model, or export back"),
    "lm_eval": ("mhar_lit.eval.lm_eval_adapter:lm_eval_main",
                "lm-evaluation-harness on a converted directory (lm_eval's own flags)"),
    "generate": ("mhar_lit.generation.cli:generate_main",
                 "continue a prompt from a checkpoint or converted directory (KV cache, greedy or sampled)"),
    "export": ("mhar_lit.export.cli:export_main",
               "a trained checkpoint as a standalone directory (safetensors, tokenizer, transformers remote code)"),
    "perplexity": ("mhar_lit.eval.perplexity_cli:perplexity_main",
                   "perplexity of a checkpoint or converted directory on a text file"),
}


def help_text() -> str:
    """`python -m mhar_lit --help`: every command with its one-line summary."""
    commands = {**LIGHTNING_COMMANDS, **{name: summary for name, (_, summary) in TOOLS.items()}}
    width = max(map(len, commands))
    lines = [f"usage: {PROG} [--debug] COMMAND [--help] ...", "",
             "Multi-Head Attention Residuals (MHAR) and its baselines with PyTorch Lightning.", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in commands.items()]
    lines += ["", f"`{PROG} COMMAND --help` shows a command's flags. --debug (or MHAR_DEBUG=1) shows the traceback",
              "of an error in the input instead of its one-line message."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- what is not ours to fix
class _DropMessages(logging.Filter):
    """Drops log records whose message matches one of the patterns; strips `Total Flops` of 0 from Lightning's
    model summary (the FLOPs are counted only with an example input, which the module does not set)."""

    def __init__(self, *patterns: str) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(p.search(message) for p in self.patterns):
            return False
        if "Total Flops" in message:
            record.msg, record.args = re.sub(r"\n\s*0\s+Total Flops", "", message), ()
        return True


def quiet_third_party() -> None:
    """Silence, once, at CLI start, the adverts, info lines and deprecation warnings that Lightning emits
    about itself: they are not ours to fix and hide what the run says. Filters by logger, module and message,
    nothing wider. (litdata's data-preparation lines are print() calls, out of reach of logging.)"""
    if getattr(quiet_third_party, "done", False):
        return
    quiet_third_party.done = True
    adverts = _DropMessages(r"Tip: .*litlogger", r"Create an account", r"lightning\.ai", r"Lightning Experiments",
                            r"Trainer already configured with model summary callbacks")  # ours: see instantiate_trainer
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.callbacks.model_summary"):
        logging.getLogger(name).addFilter(adverts)
    # litdata's StreamingDataset sizes itself per rank and worker; Lightning's generic caution does not apply
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"lightning(_fabric|_utilities)?(\.|$)")
        warnings.filterwarnings("ignore", category=category, module=r"litdata(\.|$)")


def build_cli(args: Optional[list[str]] = None, run: bool = True):
    """The LightningCLI of mhar_lit (also used by tests with run=False).

    Its Lightning subclasses are defined in here, not at module level, so that `python -m mhar_lit --help` and the
    tools that do not train never import Lightning (seconds of start-up); that is why this function is long."""
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
    from lightning.pytorch.loggers import MLFlowLogger

    from lightning.pytorch.callbacks import ModelSummary, ProgressBar

    from mhar_lit.command_line import OneLineErrors
    from mhar_lit.data.datamodule import TokenDataModule
    from mhar_lit.lit.callbacks import (LogCheckpointArtifact, OneCopyCheckpoint, RoutingMonitor, SpeedMonitor,
                                        StepProgressBar)
    from mhar_lit.lit.module import LanguageModel
    from mhar_lit.lit.summary import summary_callbacks
    from mhar_lit.lit.routing_backend import RoutingBackend

    class MLflowSaveConfig(SaveConfigCallback):
        """Stores the resolved config, credentials in URIs redacted, as the run's `config.yaml` artifact.

        Lightning's default callback asserts on trainer.log_dir, which is None for sqlite/http MLflow stores
        (pytorch-lightning#16310); for other loggers we write next to the logs as usual. The package's logger
        keeps the text until its run opens (a process that logs nothing leaves no run).
        """

        def save_config(self, trainer, pl_module, stage) -> None:
            text = redact_credentials(self.parser.dump(self.config, skip_none=False))
            for logger in trainer.loggers:
                if isinstance(logger, MLFlowLogger):
                    if hasattr(logger, "log_text"):
                        logger.log_text(text, "config.yaml")
                    elif trainer.is_global_zero:
                        logger.experiment.log_text(logger.run_id, text, "config.yaml")
                    return
            if trainer.log_dir and trainer.is_global_zero:
                os.makedirs(trainer.log_dir, exist_ok=True)
                with open(os.path.join(trainer.log_dir, "config.yaml"), "w") as fh:
                    fh.write(text)

    class RedactingParser(OneLineErrors, LightningArgumentParser):
        """Dumps (`--print_config`, the saved config) with passwords in URIs replaced by `***`; errors in one line
        with the close matches of an unknown key (mhar_lit.command_line)."""

        def dump(self, *args, **kwargs) -> str:
            return redact_credentials(super().dump(*args, **kwargs))

    class MHARCLI(LightningCLI):
        # Lightning 2.6 has no public switch for this step (LightningCLI.__init__ calls it unconditionally and
        # `load_from_checkpoint_support` governs only LightningModule.load_from_checkpoint), so the private
        # method is overridden; tests/test_cli.py fails if a resume ever takes the checkpoint's settings again.
        def _parse_ckpt_path(self) -> None:
            """Lightning would load the checkpoint's hyperparameters over the parsed config here, so a resume with
            another strategy, size or lr would silently train the checkpoint's settings (and load the whole
            file first, tens of GB at 8B). The config given is what runs; LanguageModel.on_load_checkpoint
            refuses a checkpoint whose model or strategy differs from it, naming both."""

        def before_instantiate_classes(self) -> None:
            from mhar_lit.run_folder import apply_run_name

            config = self.config[self.subcommand] if self.subcommand else self.config
            apply_run_name(config)
            check_run_inputs(self.subcommand, config)
            name_unnamed_mlflow_run(config)

        def instantiate_classes(self) -> None:
            """A bad value that a constructor refuses (heads that do not divide the width, a val_fraction out of
            range, a missing file) is a user error naming the setting, not a traceback."""
            try:
                super().instantiate_classes()
            except (UserError, SystemExit):
                raise
            except (ValueError, FileNotFoundError) as err:
                if debug_enabled():
                    raise
                kind = UserFileNotFoundError if isinstance(err, FileNotFoundError) else UserError
                raise kind(f"{setting_of(err)}{err}") from err

        def instantiate_trainer(self, **kwargs):
            """The step progress bar by default, unless the config disables the bar or brings its own; the fit
            summary; the atomic, verified checkpoint I/O beside any plugin the config gives."""
            settings = (self.config_init[self.subcommand] if self.subcommand else self.config_init)["trainer"]
            callbacks = settings.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            if settings.get("enable_progress_bar") is not False and not any(
                    isinstance(c, ProgressBar) for c in callbacks):
                callbacks = [*callbacks, StepProgressBar()]
            if settings.get("enable_model_summary") is not False and not any(
                    isinstance(c, ModelSummary) for c in callbacks):
                callbacks.append(ModelSummary())  # the logged table (Rich's prints "Total FLOPs: 0", uncounted)
            kwargs["callbacks"] = [*callbacks, *summary_callbacks(callbacks)]
            kwargs["plugins"] = with_atomic_checkpoint_io(settings.get("plugins"))
            return super().instantiate_trainer(**kwargs)

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument("--run_name", type=Optional[str], default=None,
                                help="name the run: its MLflow run name and a stable checkpoint folder "
                                     "<default_root_dir>/NAME/checkpoints, which --ckpt_path last resumes from")
            parser.add_lightning_class_args(OneCopyCheckpoint, "checkpoint")
            parser.add_lightning_class_args(SpeedMonitor, "speed")
            parser.add_lightning_class_args(RoutingMonitor, "routing_monitor")
            parser.add_lightning_class_args(RoutingBackend, "routing_backend")
            parser.set_defaults({
                # Lightning (2.6) writes last.ckpt only when a top-k save happened at that step, so save_top_k
                # must stay >= 1 (0 left no checkpoint until the end of training). Without a monitor the top-k
                # file holds what last.ckpt holds: OneCopyCheckpoint makes last.ckpt a hard link of it.
                "checkpoint.save_last": True,
                "trainer.default_root_dir": "runs",
                "trainer.logger": {
                    "class_path": "mhar_lit.lit.mlflow_logger.MLflowRunLogger",
                    "init_args": {
                        "experiment_name": DEFAULT_EXPERIMENT,
                        "tracking_uri": DEFAULT_TRACKING_URI,
                        "log_model": False,
                        "synchronous": False,
                    },
                },
            })

    return MHARCLI(
        LanguageModel,
        TokenDataModule,
        args=args,
        run=run,
        seed_everything_default=42,
        save_config_callback=MLflowSaveConfig,
        save_config_kwargs={"save_to_log_dir": False},
        # the checkpoint I/O (atomic saves, verified sha256 sidecars) is added in instantiate_trainer: as a default
        # here it was replaced by any --trainer.plugins, and jsonargparse warned it cannot serialise it
        trainer_defaults={"callbacks": [LogCheckpointArtifact()]},
        parser_kwargs={"default_env": True, "prog": PROG},
        parser_class=RedactingParser,
        auto_configure_optimizers=False,
    )


def with_atomic_checkpoint_io(plugins) -> list:
    """The config's plugins plus AtomicCheckpointIO, unless they bring a CheckpointIO of their own (then its
    saves are neither atomic nor verified, which is said once)."""
    from lightning.fabric.plugins import CheckpointIO

    from mhar_lit.lit.checkpoint_io import AtomicCheckpointIO

    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else ([plugins] if plugins is not None else [])
    own = [p for p in plugins if isinstance(p, CheckpointIO) and not isinstance(p, AtomicCheckpointIO)]
    if own:
        logging.getLogger(__name__).warning(
            "trainer.plugins brings its own checkpoint I/O (%s): checkpoints are saved without mhar_lit's atomic "
            "writes and sha256 sidecars, and a resume cannot verify them", type(own[0]).__name__)
        return plugins
    if not any(isinstance(p, AtomicCheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


def setting_of(err: BaseException) -> str:
    """`model.residual: ` (or `model: `, `data: `, `trainer: `) for an error raised while that part of the config
    was built: the innermost constructor or method on the traceback whose object is one of them."""
    import lightning as L

    from mhar_lit.residual.base import ResidualStrategy

    kinds = ((ResidualStrategy, "model.residual"), (L.LightningModule, "model"), (L.LightningDataModule, "data"),
             (L.Trainer, "trainer"), (L.Callback, "trainer.callbacks"))
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        for cls, name in kinds:
            if isinstance(owner, cls):
                return f"{name}: "
    return ""


def check_run_inputs(subcommand: Optional[str], config) -> None:
    """Refuse, before a model is built or an MLflow run opened, what would otherwise fail late or run wrong:
    a checkpoint file torch cannot read or whose sha256 sidecar does not verify, an evaluation of a randomly initialised model, a root folder that
    cannot be written (found by Lightning only at the first checkpoint save, after training)."""
    from mhar_lit.checkpoint import check_checkpoint_file, verify_checkpoint

    ckpt = config.get("ckpt_path")
    special = ckpt in ("best", "hpc") or str(ckpt).startswith("registry")  # Lightning resolves these
    # a directory is a sharded FSDP checkpoint (configs/midtrain-llama-8b.yaml): Lightning's strategy reads it
    if ckpt and "://" not in str(ckpt) and not special and not os.path.isdir(ckpt):
        check_checkpoint_file(str(ckpt))
        verify_checkpoint(str(ckpt))  # before an MLflow run opens; Lightning's load verifies again
    init_from = (config.get("model") or {}).get("init_from")
    if subcommand in ("validate", "test", "predict") and not ckpt and not init_from:
        raise UserError(f"`{subcommand}` without --ckpt_path (or model.init_from) would score a randomly "
                         "initialised model: pass the checkpoint to evaluate")
    root = (config.get("trainer") or {}).get("default_root_dir")
    if subcommand == "fit" and root and "://" not in str(root):
        _check_writable(str(root), "trainer.default_root_dir")


def _check_writable(folder: str, setting: str) -> None:
    from mhar_lit.paths import cannot_create_files_in, nearest_existing

    existing = nearest_existing(folder)  # nothing is created here: Lightning makes the folder when it saves
    reason = cannot_create_files_in(existing) if os.path.isdir(existing) else f"{existing} is not a directory"
    if reason:
        raise UserError(f"{setting} {folder!r} is not writable ({reason}); checkpoints go there")


MLFLOW_LOGGER_NAMES = ("MLFlowLogger", "MLflowRunLogger")


def name_unnamed_mlflow_run(config) -> None:
    """Give an MLflow run without a run_name one of method, size and time. MLflow's own random names come from
    the global `random`, which seed_everything has just seeded: every run of a config got the same name."""
    import datetime
    import secrets

    logger = config.get("trainer", {}).get("logger")
    if not (hasattr(logger, "get") and str(logger.get("class_path", "")).endswith(MLFLOW_LOGGER_NAMES)):
        return
    init_args = logger.get("init_args")
    if init_args is None or init_args.get("run_name") or init_args.get("run_id"):
        return
    residual = config.get("model", {}).get("residual")
    method = run_name_method(residual.get("class_path") if hasattr(residual, "get") else None)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    parts = [method, str(config.get("model", {}).get("size", "")), stamp, secrets.token_hex(2)]
    init_args["run_name"] = "-".join(p for p in parts if p)


def run_command(words: list[str], from_sys_argv: bool = False) -> int:
    """Dispatch to a tool or to LightningCLI; returns the exit code. LightningCLI reads sys.argv itself when
    the words are the command line's (given both, it warns)."""
    if not words or words[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if words[0] in TOOLS:
        module_name, func_name = TOOLS[words[0]][0].split(":")
        return getattr(importlib.import_module(module_name), func_name)(words[1:]) or 0
    build_cli(None if from_sys_argv else words)
    return 0


def redacting_excepthook(kind, value, tb) -> None:
    """Print a traceback with passwords in URIs replaced by `***` (an unreachable server's error names its URI)."""
    import traceback

    sys.stderr.write(redact_credentials("".join(traceback.format_exception(kind, value, tb))))


def main(argv: Optional[list[str]] = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in words:  # for this process and the runs a sweep starts
        words = [w for w in words if w != "--debug"]
        os.environ["MHAR_DEBUG"] = "1"
        if argv is None:
            sys.argv[1:] = words
    if debug_enabled():
        os.environ.setdefault("JSONARGPARSE_DEBUG", "true")  # jsonargparse's own traceback for a parsing error
    if argv is None:
        sys.excepthook = redacting_excepthook
    quiet_third_party()
    try:
        code = run_command(words, from_sys_argv=argv is None)
    except UserError as err:
        if debug_enabled():
            raise
        code = report_user_error(err)
    sys.exit(code)


if __name__ == "__main__":
    main()
