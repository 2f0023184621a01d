"""Arguments of a tiny CPU `fit` through the real LightningCLI: a 2-layer model, 32-token sequences, a corpus of
twelve documents written into the test's folder, an MLflow sqlite store there."""

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "routing", "depth", "residual", "head", "layer", "token"]


def tiny_corpus(folder: Path) -> Path:
    corpus = folder / "corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        rng = torch.Generator().manual_seed(0)
        for i in range(12):
            idx = torch.randint(0, len(WORDS), (800,), generator=rng).tolist()
            (corpus / f"doc{i}.txt").write_text(" ".join(WORDS[j] for j in idx))
    return corpus


def tiny_fit_args(folder: Path, *extra: str) -> list[str]:
    """`fit` arguments (without the subcommand) writing everything under `folder`."""
    return [
        "--config", str(REPO / "configs/demo.yaml"),
        "--model.size", "tiny",
        "--model.residual", "mhar_lit.residual.FullAttnRes", "--model.residual.init_args.heads", "4",
        "--model.warmup_steps", "2",
        "--model.decay_steps", "8",
        "--model.tail_k", "2",
        "--data.data", str(tiny_corpus(folder)),
        "--data.seq_len", "32",
        "--data.batch_size", "4",
        "--data.val_batch_size", "4",
        "--data.val_fraction", "0.2",
        "--data.cache_dir", str(folder / "cache"),
        "--trainer.default_root_dir", str(folder / "runs"),
        "--trainer.val_check_interval", "3",
        "--trainer.limit_val_batches", "2",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{folder}/mlflow.db",
        "--trainer.logger.init_args.synchronous", "true",
        "--routing_monitor.every_n_steps", "100",
        *extra,
    ]
