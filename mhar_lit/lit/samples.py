"""`SampleText`: continue a few fixed prompts at each validation and log the text to MLflow.

Reading a handful of continuations over training shows what loss curves do not (repetition, syntax,
copying). Each logged validation writes one artifact `samples/step_000500.txt` with, for every prompt, its
greedy continuation and one sampled with a fixed seed (the same draws at every step, so steps compare).
Rank zero only, a no-op without an MLflow logger, skipped during the sanity check. Generation uses the KV
cache of mhar_lit.generation on the PyTorch routing backend (restored afterwards).

Not for FSDP-sharded models: a forward on rank zero alone would wait forever for the other ranks'
parameter shards, so the callback skips them with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import lightning as L
import torch

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("def ", "class ", "import ")


class SampleText(L.Callback):
    """Every `every_n_val`-th validation: greedy and seeded samples of `max_new_tokens` for each prompt."""

    def __init__(self, prompts: Sequence[str] = DEFAULT_PROMPTS, max_new_tokens: int = 64, every_n_val: int = 1,
                 temperature: float = 0.8, top_k: Optional[int] = None, top_p: Optional[float] = 0.95,
                 seed: int = 0) -> None:
        from mhar_lit.generation.sampling import Sampling

        if not prompts:
            raise ValueError("SampleText needs at least one prompt")
        if max_new_tokens < 1 or every_n_val < 1:
            raise ValueError(f"max_new_tokens and every_n_val must be >= 1, got {max_new_tokens} and {every_n_val}")
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.every_n_val = every_n_val
        self.sampling = Sampling(temperature, top_k, top_p)
        self.seed = seed
        self._validations = 0
        self._warned = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if self._validations % self.every_n_val != 0 or not trainer.is_global_zero:
            return
        from mhar_lit.lit.callbacks import _mlflow_logger

        mlflow = _mlflow_logger(trainer)
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
        if mlflow is None:
            return
        if tokenizer is None or "FSDP" in type(trainer.strategy).__name__:
            self._warn_once("SampleText skipped: " + ("the datamodule has no tokenizer" if tokenizer is None
                                                      else "a rank-zero forward cannot run on FSDP-sharded weights"))
            return
        text = self.samples(pl_module.model, tokenizer, trainer.global_step)
        mlflow.experiment.log_text(mlflow.run_id, text, f"samples/step_{trainer.global_step:06d}.txt")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message)

    def samples(self, model: torch.nn.Module, tokenizer: Any, step: int) -> str:
        """The artifact's text: every prompt continued greedily and with the seeded sampler."""
        from mhar_lit.generation.decoding import generate
        from mhar_lit.generation.sampling import Sampling

        prompts = [tokenizer.encode_batch([p])[0].tolist() or [tokenizer.eos_id] for p in self.prompts]
        device = model.embed_tokens.weight.device
        was_training = model.training
        model.eval()
        try:
            runs = {}
            for name, sampling in (("greedy", Sampling()), (f"sampled {self._describe()}", self.sampling)):
                generator = torch.Generator(device=device).manual_seed(self.seed)
                runs[name] = generate(model, prompts, self.max_new_tokens, sampling, generator,
                                      eos_ids=(tokenizer.eos_id,))
        finally:
            model.train(was_training)
        parts = [f"step {step}"]
        for index, prompt in enumerate(self.prompts):
            for name, tokens in runs.items():
                parts.append(f"=== {prompt!r} ({name}) ===\n{prompt}{tokenizer.decode(tokens[index])}")
        return "\n\n".join(parts) + "\n"

    def _describe(self) -> str:
        s = self.sampling
        knobs = [f"temperature {s.temperature:g}"] + ([f"top_k {s.top_k}"] if s.top_k else []) + (
            [f"top_p {s.top_p:g}"] if s.top_p else [])
        return f"seed {self.seed}, " + ", ".join(knobs)
