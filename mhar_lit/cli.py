"""`python -m mhar_lit ...`: LightningCLI (fit / validate / test / predict) plus the package's own tools.

    python -m mhar_lit fit --config configs/demo.yaml        train (MLflow run in ./mlflow.db by default)
    python -m mhar_lit sweep --config base.yaml --grid ...   cross product of settings, one MLflow run each
    python -m mhar_lit compare --sweep ID                     table of results with paired deltas
    python -m mhar_lit probe --ckpt PATH                      routing analysis of a trained checkpoint
    python -m mhar_lit convert --from HF_DIR --to DIR         graft a strategy onto a pretrained model
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

from mhar_lit.tracking import DEFAULT_EXPERIMENT, DEFAULT_TRACKING_URI, run_name_method

TOOLS = {
    "sweep": "mhar_lit.sweep:sweep_main",
    "compare": "mhar_lit.sweep:compare_main",
    "probe": "mhar_lit.analysis.probe:probe_main",
    "convert": "mhar_lit.convert:convert_main",
    "lm_eval": "mhar_lit.eval.lm_eval_adapter:lm_eval_main",
}

def build_cli(args: Optional[list[str]] = None, run: bool = True):
    """The LightningCLI of mhar_lit (also used by tests with run=False)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
    from lightning.pytorch.loggers import MLFlowLogger

    from mhar_lit.data.datamodule import TokenDataModule
    from mhar_lit.lit.callbacks import LogCheckpointArtifact, RoutingMonitor, SpeedMonitor
    from mhar_lit.lit.module import LanguageModel
    from mhar_lit.lit.routing_backend import RoutingBackend

    class MLflowSaveConfig(SaveConfigCallback):
        """Stores the resolved config as the run's `config.yaml` artifact.

        Lightning's default callback asserts on trainer.log_dir, which is None for sqlite/http MLflow stores
        (pytorch-lightning#16310); for other loggers we write next to the logs as usual.
        """

        def save_config(self, trainer, pl_module, stage) -> None:
            text = self.parser.dump(self.config, skip_none=False)
            for logger in trainer.loggers:
                if isinstance(logger, MLFlowLogger):
                    logger.experiment.log_text(logger.run_id, text, "config.yaml")
                    return
            if trainer.log_dir and trainer.is_global_zero:
                os.makedirs(trainer.log_dir, exist_ok=True)
                with open(os.path.join(trainer.log_dir, "config.yaml"), "w") as fh:
                    fh.write(text)

    class MHARCLI(LightningCLI):
        def _parse_ckpt_path(self) -> None:
            """Lightning would load the checkpoint's hyperparameters over the parsed config here, so a resume with
            another strategy, size or lr would silently train the checkpoint's settings (and load the whole
            file first, tens of GB at 8B). The config given is what runs; LanguageModel.on_load_checkpoint
            refuses a checkpoint whose model or strategy differs from it, naming both."""

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            check_run_inputs(self.subcommand, config)
            name_unnamed_mlflow_run(config)

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
            parser.add_lightning_class_args(SpeedMonitor, "speed")
            parser.add_lightning_class_args(RoutingMonitor, "routing_monitor")
            parser.add_lightning_class_args(RoutingBackend, "routing_backend")
            parser.set_defaults({
                # Lightning (2.6) writes last.ckpt only when a top-k save happened at that step, so save_top_k
                # must stay >= 1 (0 left no checkpoint until the end of training). Without a monitor the top-k
                # file is a copy of last.ckpt: `--checkpoint.save_last link` makes last.ckpt a link to it instead.
                "checkpoint.save_last": True,
                "trainer.default_root_dir": "runs",
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.MLFlowLogger",
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
        trainer_defaults={"callbacks": [LogCheckpointArtifact()]},
        parser_kwargs={"default_env": True},
        auto_configure_optimizers=False,
    )


def check_run_inputs(subcommand: Optional[str], config) -> None:
    """Refuse, before a model is built or an MLflow run opened, what would otherwise fail late or run wrong:
    a checkpoint file torch cannot read, an evaluation of a randomly initialised model, a root folder that
    cannot be written (found by Lightning only at the first checkpoint save, after training)."""
    from mhar_lit.lit.module import check_checkpoint_file

    ckpt = config.get("ckpt_path")
    special = ckpt in ("last", "best", "hpc") or str(ckpt).startswith("registry")  # Lightning resolves these
    # a directory is a sharded FSDP checkpoint (configs/midtrain-llama-8b.yaml): Lightning's strategy reads it
    if ckpt and "://" not in str(ckpt) and not special and not os.path.isdir(ckpt):
        check_checkpoint_file(str(ckpt))
    init_from = (config.get("model") or {}).get("init_from")
    if subcommand in ("validate", "test", "predict") and not ckpt and not init_from:
        raise ValueError(f"`{subcommand}` without --ckpt_path (or model.init_from) would score a randomly "
                         "initialised model: pass the checkpoint to evaluate")
    root = (config.get("trainer") or {}).get("default_root_dir")
    if subcommand == "fit" and root and "://" not in str(root):
        _check_writable(str(root), "trainer.default_root_dir")


def _check_writable(folder: str, setting: str) -> None:
    from mhar_lit.paths import cannot_create_files_in, nearest_existing

    existing = nearest_existing(folder)  # nothing is created here: Lightning makes the folder when it saves
    reason = cannot_create_files_in(existing) if os.path.isdir(existing) else f"{existing} is not a directory"
    if reason:
        raise ValueError(f"{setting} {folder!r} is not writable ({reason}); checkpoints go there")


def name_unnamed_mlflow_run(config) -> None:
    """Give an MLflow run without a run_name one of method, size and time. MLflow's own random names come from
    the global `random`, which seed_everything has just seeded: every run of a config got the same name."""
    import datetime
    import secrets

    logger = config.get("trainer", {}).get("logger")
    if not (hasattr(logger, "get") and str(logger.get("class_path", "")).endswith("MLFlowLogger")):
        return
    init_args = logger.get("init_args")
    if init_args is None or init_args.get("run_name") or init_args.get("run_id"):
        return
    residual = config.get("model", {}).get("residual")
    method = run_name_method(residual.get("class_path") if hasattr(residual, "get") else None)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    parts = [method, str(config.get("model", {}).get("size", "")), stamp, secrets.token_hex(2)]
    init_args["run_name"] = "-".join(p for p in parts if p)


def main(argv: Optional[list[str]] = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] in TOOLS:
        module_name, func_name = TOOLS[words[0]].split(":")
        sys.exit(getattr(importlib.import_module(module_name), func_name)(words[1:]) or 0)
    build_cli(argv)  # None: LightningCLI reads sys.argv itself (given sys.argv[1:] as args, it warns)


if __name__ == "__main__":
    main()
