"""`python -m mhar_lit probe`: the query probe of docs/method.md G on a trained checkpoint.

    python -m mhar_lit probe --ckpt runs/.../last.ckpt [--data PATH | --tokens_file ids.npy] [--tokens 100000]
        [--slices 4] [--null_draws 5] [--seed 0] [--out probe_out] [--tracking_uri URI --run_id ID]

Over a fixed held-out token set, every routing site's sources are captured (capture.observe_sources) and
reduced on the fly (stats.RoutingStats) to: the shared routing distribution per head; for single-head
models the S-slice width-disagreement KL with its matched-norm random-query null and the learned excess;
for multi-head models the per-head deviation from the head consensus, its null and its split-half
replication; and the source collinearity at the final site. Output: report.json plus heatmap PNGs in --out,
optionally logged as artifacts (and summary metrics) to an existing MLflow run.
"""

from __future__ import annotations


import contextlib
import json
import math
import os
import sys
from typing import Any, Optional

import torch
from torch import Tensor, nn

from mhar_lit.analysis.capture import observe_sources, routed_residual
from mhar_lit.analysis.metrics import head_deviation, matched_norm_queries
from mhar_lit.analysis.stats import RoutingStats
from mhar_lit.command_line import checked_type, command_parser, positive_int
from mhar_lit.errors import exits_on_user_error

REPORT_FILE = "report.json"
ARTIFACT_DIR = "probe"


def site_kind(site: int, num_layers: int) -> str:
    if site == 2 * num_layers:
        return "final"
    return "attention" if site % 2 == 0 else "mlp"


def _forward(model: nn.Module, input_ids_BT: Tensor) -> None:
    # hidden_states skips the LM head: its [B, T, V] logits are the largest tensor and the probe needs none.
    run = getattr(model, "hidden_states", model)
    run(input_ids_BT)


@torch.no_grad()
def collect_stats(model: nn.Module, input_ids_QT: Tensor, slices: int = 4, null_draws: int = 5, seed: int = 0,
                  batch_size: int = 8) -> RoutingStats:
    """Run the model over the sequences [Q, T] in order and accumulate every probe statistic.

    The first ceil(Q/2) sequences form split half 0, the rest half 1 (disjoint texts). The null queries
    are drawn once per site from `seed` before any forward pass, so the report depends only on the seed.
    """
    residual = routed_residual(model)
    if batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
    if null_draws < 1:
        raise ValueError(f"--null_draws must be >= 1, got {null_draws}")
    if slices < 1:
        raise ValueError(f"--slices must be >= 1, got {slices}")
    generator = torch.Generator().manual_seed(seed)
    query_SD = residual.effective_query().detach().float()  # the queries the router uses (logit_scale applied)
    null_RSD = matched_norm_queries(query_SD, residual.heads, null_draws, generator)
    stats = RoutingStats(query_SD, residual.key_norm.detach().float(), residual.heads,
                         slices, null_RSD, collinearity_site=residual.query.shape[0] - 1, eps=residual.eps)
    device = next(model.parameters()).device
    half_Q = (torch.arange(input_ids_QT.shape[0]) >= math.ceil(input_ids_QT.shape[0] / 2)).long()
    current = {"half": half_Q[:0]}
    with observe_sources(model, lambda site, sources: stats.observe(site, sources, current["half"])):
        for start in range(0, input_ids_QT.shape[0], batch_size):
            current["half"] = half_Q[start : start + batch_size]
            _forward(model, input_ids_QT[start : start + batch_size].to(device))
    return stats


def build_report(stats: RoutingStats, model: nn.Module, input_ids_QT: Tensor, seed: int,
                 null_draws: int) -> dict[str, Any]:
    """Every number of the probe as plain JSON-able values (no paths, no times: reproducible bit for bit)."""
    residual = routed_residual(model)
    num_layers = model.config.num_layers
    sites = []
    for site in sorted(stats.sites):
        entry = {"site": site, "layer": site // 2 if site < 2 * num_layers else None,
                 "kind": site_kind(site, num_layers)}
        entry.update(stats.site_summary(site))
        sites.append(entry)
    return {
        "seed": seed,
        "tokens": int(input_ids_QT.numel()),
        "sequences": int(input_ids_QT.shape[0]),
        "seq_len": int(input_ids_QT.shape[1]),
        "heads": residual.heads,
        "slices": stats.slices,
        "null_draws": null_draws,
        "residual": type(residual).__name__,
        "width_disagreement": stats.width_disagreement(),
        "head_deviation": stats.head_deviation_summary(),
        "collinearity": stats.collinearity(),
        "sites": sites,
    }


def probe_model(model: nn.Module, input_ids_QT: Tensor, slices: int = 4, null_draws: int = 5, seed: int = 0,
                batch_size: int = 8) -> tuple[dict[str, Any], RoutingStats]:
    """The probe's report (and the raw accumulator, for figures) of a model on the sequences [Q, T]."""
    stats = collect_stats(model, input_ids_QT, slices, null_draws, seed, batch_size)
    return build_report(stats, model, input_ids_QT, seed, null_draws), stats


# ---------------------------------------------------------------------- outputs
def write_figures(stats: RoutingStats, out_dir: str) -> list[str]:
    """Heatmaps of the routing weights (and deviations, or the per-site KL); [] without matplotlib."""
    from mhar_lit.analysis import plots

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("probe: matplotlib is not installed; skipping the PNG figures", file=sys.stderr)
        return []
    written = []
    weights = {s: stats.mean_weights(s) for s in stats.sites}
    path = os.path.join(out_dir, "routing_weights.png")
    plots.heads_heatmap(weights, "token-averaged routing weights (sites x sources)", path)
    written.append(path)
    multi = stats.multi_source_sites()
    if stats.heads > 1 and multi:
        path = os.path.join(out_dir, "head_deviation.png")
        deviations = {s: head_deviation(weights[s]) for s in multi}
        plots.heads_heatmap(deviations, "per-head deviation from the head consensus", path, diverging=True,
                            label="Delta (weight - consensus)")
        written.append(path)
    summary = stats.width_disagreement()
    if summary is not None:
        path = os.path.join(out_dir, "width_disagreement.png")
        per_site = [stats.site_summary(s)["width_disagreement"] for s in summary["sites"]]
        plots.disagreement_plot(summary["sites"], [p["trained"] for p in per_site], [p["null"] for p in per_site],
                                f"width-disagreement, S = {stats.slices} slices", path)
        written.append(path)
    return written


def summary_metrics(report: dict[str, Any]) -> dict[str, float]:
    """Headline numbers as flat MLflow metric names (None values are left out)."""
    metrics = {}
    for section, keys in (("width_disagreement", ("trained", "null", "excess")),
                          ("head_deviation", ("max_abs", "max_abs_first_10_sites", "null_max_abs", "split_half_r",
                                              "cross_head_r")),
                          ("collinearity", ("mean_pairwise_cosine",))):
        values = report.get(section) or {}
        for key in keys:
            if values.get(key) is not None:
                metrics[f"probe/{section}/{key}"] = float(values[key])
    return metrics


def log_to_mlflow(tracking_uri: str, run_id: str, paths: list[str], metrics: dict[str, float]) -> None:
    """Attach the probe's files (under probe/) and headline metrics to an existing MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for path in paths:  # the run's existence was checked before the probe ran (check_mlflow_run)
        client.log_artifact(run_id, path, artifact_path=ARTIFACT_DIR)
    for key, value in metrics.items():
        client.log_metric(run_id, key, value)


# ---------------------------------------------------------------------- checks before any work
def check_out_dir(out: str) -> None:
    """Refuse an --out the report could not be written to, before any work (an existing directory is reused:
    its report.json and figures are overwritten). Nothing is created here, so a failed run leaves no trace."""
    if not out:
        raise ValueError("--out must not be empty")
    if os.path.lexists(out) and not os.path.isdir(out):  # lexists: a dangling link too
        raise ValueError(f"--out {out} exists and is not a directory")
    from mhar_lit.paths import cannot_create_files_in, nearest_existing

    existing = nearest_existing(out)  # the directory that os.makedirs would create it in
    if not os.path.isdir(existing):
        raise ValueError(f"--out {out} cannot be created: {existing} is not a directory")
    reason = cannot_create_files_in(existing)
    if reason:
        raise ValueError(f"--out {out} is not writable: cannot create files in {existing} ({reason})")


def check_mlflow_run(tracking_uri: str, run_id: str) -> None:
    """Refuse a store or run the outputs could not be logged to, before any work. A probe logs into an existing
    run, so a sqlite file that does not exist is a typo, not a new store to create."""
    from mlflow.tracking import MlflowClient

    from mhar_lit.tracking import local_store_path

    path = local_store_path(tracking_uri)
    if path is not None and not os.path.exists(path):
        raise ValueError(f"--tracking_uri {tracking_uri}: no MLflow store at {path} (the probe logs into an existing "
                         "run and does not create a store)")
    try:
        run = MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    except Exception as err:  # MlflowException (no such run, bad scheme), SQLAlchemy's error for a non-database file
        reason = str(getattr(err, "message", err)).splitlines()[0]  # SQLAlchemy appends the SQL text
        raise ValueError(f"--run_id {run_id}: cannot read this run at --tracking_uri {tracking_uri}: {reason}") from err
    if run.info.lifecycle_stage != "active":  # MLflow refuses to log into a deleted run
        raise ValueError(f"--run_id {run_id} at {tracking_uri} is {run.info.lifecycle_stage}, not active")


# ---------------------------------------------------------------------- command line
_positive_int = positive_int
# torch.Generator.manual_seed takes [-2**63, 2**64) and fails deep in the run outside it
_seed = checked_type(int, lambda v: -2**63 <= v < 2**64, "in [-2**63, 2**64)", "a whole number")
# 0 holds out no document; 1 every one (a separate evaluation corpus probed whole); also refuses nan
_open_fraction = checked_type(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]", "a number")


def build_parser():
    """jsonargparse's conventions (`--seq_len`); the hyphenated spellings (`--seq-len`) are accepted too."""
    parser = command_parser("probe", __doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="an mhar_lit Lightning checkpoint (.ckpt)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", help="held-out text: a .txt/.jsonl/.parquet file, directory or glob, or a "
                                       "litdata-optimized directory (default: the embedded corpus)")
    source.add_argument("--tokens_file", "--tokens-file",
                        help="token ids, .npy or .pt, 1-D stream or 2-D [sequences, length]")
    parser.add_argument("--tokenizer", help="tokenizer for --data / the embedded corpus: 'bytes' or a tokenizer.json "
                                            "(default: the checkpoint's datamodule setting, else 'bytes')")
    parser.add_argument("--val_fraction", "--val-fraction", type=_open_fraction,
                        help="held-out fraction of documents, 0 < v <= 1 (content hash, as in training; default: the "
                             "checkpoint's, else 0.005)")
    parser.add_argument("--text_field", "--text-field", default="text",
                        help="the text column of .jsonl/.parquet inputs")
    parser.add_argument("--tokens", type=_positive_int, default=100_000, help="number of held-out tokens")
    parser.add_argument("--seq_len", "--seq-len", type=_positive_int,
                        help="sequence length (default: the one the run trained with, else min(1024, max positions))")
    parser.add_argument("--batch_size", "--batch-size", type=_positive_int, default=8, help="sequences per forward")
    parser.add_argument("--slices", type=_positive_int, default=4, help="query slices S for the width-disagreement")
    parser.add_argument("--null_draws", "--null-draws", type=_positive_int, default=5,
                        help="matched-norm random queries to average")
    parser.add_argument("--seed", type=_seed, default=0, help="seed of the random null")
    parser.add_argument("--out", default="probe_out", help="output directory (report.json and PNGs)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--no_figures", "--no-figures", action="store_true", help="write report.json only")
    parser.add_argument("--tracking_uri", "--tracking-uri",
                        help="MLflow tracking URI of the run to attach the outputs to")
    parser.add_argument("--run_id", "--run-id", help="MLflow run id (with --tracking_uri)")
    parser.add_argument("--trust_checkpoint", "--trust-checkpoint", action="store_true",
                        help="allow a checkpoint with pickled Python objects (only for files you created)")
    parser.add_argument("--allow_unverified", "--allow-unverified", action="store_true",
                        help="accept a checkpoint that has no .sha256 sidecar (a mismatching one is always refused)")
    parser.add_argument("--allow_class", "--allow-class", action="append", default=[],
                        help="a residual strategy class path outside mhar_lit.residual that the checkpoint may name "
                             "(your own strategy; repeatable)")
    return parser


def default_seq_len(args: Any, model: nn.Module, saved: dict[str, Any]) -> int:
    """--seq_len, else the sequence length the run trained with (its datamodule settings), else
    min(1024, max positions): a model probed at lengths it never saw routes differently."""
    context = model.config.max_position_embeddings
    if args.seq_len is not None:
        return args.seq_len
    return min(int(saved.get("seq_len") or min(1024, context)), context)


def _input_ids(args: Any, model: nn.Module, saved: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
    from mhar_lit.analysis.tokens import DEFAULT_VAL_FRACTION, heldout_tokens, load_token_file, to_sequences
    from mhar_lit.checkpoint import build_tokenizer, tokenizer_spec

    seq_len = default_seq_len(args, model, saved)
    if args.tokens_file:
        ids, origin = load_token_file(args.tokens_file), {"kind": "tokens_file", "path": args.tokens_file}
    else:
        override = args.tokenizer or (None if saved.get("tokenizer") else "bytes")
        spec, eos = tokenizer_spec(saved, override, where=f"the checkpoint {args.ckpt}")  # bpe: its cached file
        tokenizer = build_tokenizer(spec, eos, "--tokenizer" if args.tokenizer else f"recorded in {args.ckpt}")
        fraction = args.val_fraction if args.val_fraction is not None else saved.get("val_fraction",
                                                                                       DEFAULT_VAL_FRACTION)
        ids, origin = heldout_tokens(args.data, tokenizer, args.tokens, seq_len, fraction, args.text_field)
    ids_QT = to_sequences(ids, args.tokens, seq_len)
    if ids.numel() < args.tokens:  # not when only the cut into whole sequences of seq_len fell short
        print(f"probe: warning: only {ids.numel()} held-out tokens (asked for {args.tokens}); pass more text "
              "with --data / --tokens_file, or a larger --val_fraction (at most the one used in training)",
              file=sys.stderr)
    vocab = model.config.vocab_size
    if int(ids_QT.min()) < 0 or int(ids_QT.max()) >= vocab:
        raise ValueError(f"token ids span [{int(ids_QT.min())}, {int(ids_QT.max())}] but the model's vocab_size "
                         f"is {vocab}: wrong tokenizer or tokens file for this checkpoint?")
    return ids_QT, origin


def _check_device(device: str) -> None:
    """A clear error for an unknown or absent device before the model is loaded."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:  # torch asserts when built without CUDA
        raise ValueError(f"--device {device} is not usable: {err}") from err


def _check_fits_model(args: Any, model: nn.Module) -> None:
    """The flags that depend on the model, checked before any data is read."""
    max_positions = model.config.max_position_embeddings
    if args.seq_len is not None and args.seq_len > max_positions:
        raise ValueError(f"--seq_len {args.seq_len} exceeds the model's max_position_embeddings {max_positions}")
    residual = routed_residual(model)  # also the error for a strategy without routing
    width = residual.query.shape[-1]
    if residual.heads == 1 and width % args.slices != 0:
        raise ValueError(f"width {width} is not divisible by --slices {args.slices}")


def run(args: Any) -> dict[str, Any]:
    from mhar_lit.checkpoint import read_checkpoint
    from mhar_lit.residual.base import ALLOWED_PACKAGES

    if bool(args.tracking_uri) != bool(args.run_id):
        raise ValueError("--tracking_uri and --run_id go together")
    # Everything that can be checked without the model is, so a mistake never costs a full probe run.
    check_out_dir(args.out)
    if args.tracking_uri:
        check_mlflow_run(args.tracking_uri, args.run_id)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(device)
    contents = read_checkpoint(args.ckpt, trust_pickle=args.trust_checkpoint, with_tokenizer=False,
                               allowed=ALLOWED_PACKAGES + tuple(args.allow_class),
                               allow_unverified=args.allow_unverified)
    model = contents.model
    _check_fits_model(args, model)
    model.to(device)
    ids_QT, origin = _input_ids(args, model, contents.data_settings)
    report, stats = probe_model(model, ids_QT, args.slices, args.null_draws, args.seed, args.batch_size)
    report = {"checkpoint": os.path.abspath(args.ckpt), "token_source": origin,
              "model": {"config": model.config.to_dict(), "residual": model.residual.to_config()}, **report}
    text = json.dumps(report, indent=1, allow_nan=False)  # serialised first: a NaN can't leave a half-written file
    os.makedirs(args.out, exist_ok=True)
    report_path = os.path.join(args.out, REPORT_FILE)
    partial = report_path + ".partial"  # a full disk or a kill mid-write leaves the previous report whole
    try:
        with open(partial, "w") as fh:
            fh.write(text)
        os.replace(partial, report_path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise ValueError(f"cannot write {report_path}: {err.strerror or err}") from err
    files = [report_path] + ([] if args.no_figures else write_figures(stats, args.out))
    if args.tracking_uri:
        log_to_mlflow(args.tracking_uri, args.run_id, files, summary_metrics(report))
    return report


def verdict(report: dict[str, Any]) -> list[str]:
    """What the headline numbers mean, in words: learned structure beyond the matched-norm random-query null,
    or not (docs/probe.md)."""
    lines = []
    deviation = report.get("head_deviation")
    if deviation:
        trained, null = deviation["max_abs"], deviation["null_max_abs"]
        beyond = trained > null
        lines.append(f"heads {'differ' if beyond else 'do not differ'} from their consensus beyond the null: "
                     f"max |deviation| {trained:.4f} vs {null:.4f} for random queries of the same norm")
        r = deviation.get("split_half_r")
        if r is not None:
            lines.append(f"the same deviations in two disjoint halves of the text: split-half r {r:.2f} (1: identical, "
                         "0: unrelated, noise)")
    width = report.get("width_disagreement")
    if width:
        lines.append(f"query slices {'disagree' if width['excess'] > 0 else 'do not disagree'} beyond the null: "
                     f"KL {width['trained']:.4f} vs {width['null']:.4f} (excess {width['excess']:+.4f})")
    return lines


def _print_summary(report: dict[str, Any], out: str) -> None:
    print(f"probe: {report['tokens']} tokens ({report['sequences']} x {report['seq_len']}), "
          f"{len(report['sites'])} sites, heads={report['heads']} -> {out}")
    for line in verdict(report):
        print(f"  {line}")
    for key, value in summary_metrics(report).items():
        print(f"    {key.removeprefix('probe/')}: {value:.4f}")


@exits_on_user_error(ValueError, FileNotFoundError)  # bad input from the data and tokenizer layers too
def probe_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    _print_summary(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(probe_main())
