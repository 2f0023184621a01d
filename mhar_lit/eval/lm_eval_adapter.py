"""lm-evaluation-harness adapter: `--model mhar_lit --model_args path=DIR,tokenizer=DIR/tokenizer.json,...`.

lm_eval has no plugin discovery for models, so the model name is registered when this module is
imported; the bundled launcher does that and then runs lm_eval's own CLI:

    python -m mhar_lit.eval --model mhar_lit --model_args path=runs/8b-ema,dtype=bfloat16 --tasks gsm8k ...

`MHARScorer` holds all the logic (tokenisation, windows, batching, greedy decoding) and needs neither
lm_eval nor transformers, so it is tested directly; `MHARLM` only unpacks lm_eval's Instances.

Conventions follow lm_eval's HF model: a context's trailing whitespace moves to the continuation, the
continuation's tokens are those of tokenize(context + continuation) beyond tokenize(context), an empty
context is replaced by the prefix token (EOS unless `prefix_token_id` is given), rolling loglikelihoods
use disjoint windows of `max_length` tokens. Generation decodes with a KV cache (mhar_lit.generation) in
left-padded batches, greedily or by sampling (do_sample, temperature, top_k, top_p; seeded by `seed`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mhar_lit.errors import UserError, UserFileNotFoundError, exits_on_user_error
from mhar_lit.generation.sampling import Sampling

log = logging.getLogger(__name__)

MODEL_NAME = "mhar_lit"


class TokenizerJSON:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library (no transformers)."""

    def __init__(self, path: str | Path, eos: Optional[str | int] = None) -> None:
        from mhar_lit.data.tokenizer import read_tokenizer_json

        self.path = Path(path)
        if not self.path.is_file():
            raise UserFileNotFoundError(f"tokenizer file {self.path} not found (pass tokenizer=PATH/tokenizer.json)")
        self.tok = read_tokenizer_json(self.path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos(eos)

    def _eos(self, eos: Optional[str | int]) -> Optional[int]:
        from mhar_lit.data.tokenizer import EOS_CANDIDATES  # the one default EOS of every reader

        if isinstance(eos, int) or (isinstance(eos, str) and eos.isdigit()):
            return int(eos)
        for name in ([eos] if eos else EOS_CANDIDATES):
            token_id = self.tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class MHARScorer:
    """Loglikelihoods and generations of a DecoderLM, batched, in the lm_eval conventions."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: Optional[int] = None,
                 batch_size: int = 8, prefix_token_id: Optional[int] = None, max_gen_toks: int = 256,
                 seed: int = 1234) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length or model.config.max_position_embeddings)
        self.batch_size = int(batch_size)
        self.prefix_token_id = prefix_token_id if prefix_token_id is not None else getattr(tokenizer, "eos_id", None)
        if self.prefix_token_id is None:
            raise ValueError("no prefix token: the tokenizer has no EOS; pass prefix_token_id")
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ model calls
    @torch.no_grad()
    def _logprobs_at(self, rows: list[list[int]], positions: list[list[int]]) -> list[Tensor]:
        """log-softmax [len(pos), V] (fp32) at the given positions of each row, one right-padded forward."""
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)  # right padding never affects earlier (causal) positions
        hidden = self.model.hidden_states(ids.to(self.device))
        out = []
        for i, pos in enumerate(positions):
            # The LM head only where needed: a full [B, T, V] fp32 tensor is gigabytes for a 128K vocabulary.
            logits = self.model.lm_head(hidden[i, pos]).float()
            out.append(F.log_softmax(logits, dim=-1))
        return out

    def _batches(self, order: list[int]) -> list[list[int]]:
        return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    # ------------------------------------------------------------------ loglikelihood
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix_token_id], self.tokenizer.encode(continuation)
        whole, ctx = self.tokenizer.encode(context + continuation), self.tokenizer.encode(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in pairs])

    def loglikelihood_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy choice) per pair."""
        rows, targets = [], []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("empty continuation: nothing to score")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            tokens = (list(ctx) + list(cont))[-(self.max_length + 1):]  # keep the most recent context
            rows.append(tokens[:-1])
            targets.append(list(cont))
        results: list[Optional[tuple[float, bool]]] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths share a batch
        for batch in self._batches(order):
            positions = [list(range(len(rows[i]) - len(targets[i]), len(rows[i]))) for i in batch]
            logprobs = self._logprobs_at([rows[i] for i in batch], positions)
            for i, lp in zip(batch, logprobs):
                target = torch.tensor(targets[i], device=lp.device)
                score = lp.gather(-1, target[:, None]).sum().item()
                results[i] = (score, bool((lp.argmax(-1) == target).all()))
        return results  # type: ignore[return-value]

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, targets) windows that score every token once, the first one after the prefix token."""
        full, windows = [self.prefix_token_id] + tokens, []
        for start in range(0, len(tokens), self.max_length):
            count = min(self.max_length, len(tokens) - start)
            first = max(0, start + count - self.max_length)
            windows.append((full[first : start + 1], full[start + 1 : start + 1 + count]))
        return windows

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        windows, owner = [], []
        for i, text in enumerate(texts):
            for window in self.rolling_windows(self.tokenizer.encode(text)):
                windows.append(window)
                owner.append(i)
        totals = [0.0] * len(texts)
        for i, (score, _) in zip(owner, self.loglikelihood_tokens(windows)):
            totals[i] += score
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
        """Continuations cut at the first stop string (`until`), EOS or `max_gen_toks` tokens, decoded with a KV
        cache in left-padded batches of requests that share their generation settings. Sampling draws from a
        generator seeded with `seed` at every call, so a call is reproducible."""
        rules = [self._rules(dict(kwargs or {})) for _, kwargs in requests]
        groups: dict[tuple, list[int]] = {}
        for i, rule in enumerate(rules):
            groups.setdefault(rule, []).append(i)
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        results: list[Optional[str]] = [None] * len(requests)
        for rule, members in groups.items():
            members.sort(key=lambda i: -len(requests[i][0]))  # similar lengths share a batch: less padding
            for batch in self._batches(members):
                for i, text in zip(batch, self._generate([requests[i][0] for i in batch], *rule, generator)):
                    results[i] = text
        return results  # type: ignore[return-value]

    def _rules(self, kwargs: dict[str, Any]) -> tuple[tuple[str, ...], int, Sampling]:
        """(until, max_gen_toks, sampling) of a request. As lm_eval's HF model: sampling when do_sample is true,
        or when it is absent and temperature > 0; do_sample without a temperature samples at 1.0."""
        until = kwargs.get("until") or []
        until = (until,) if isinstance(until, str) else tuple(until)
        temperature = kwargs.get("temperature")
        do_sample = kwargs.get("do_sample")
        if do_sample is None:
            do_sample = temperature is not None and float(temperature) > 0
        if not do_sample:
            return until, int(kwargs.get("max_gen_toks", self.max_gen_toks)), Sampling()
        top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
        sampling = Sampling(float(1.0 if temperature is None else temperature),
                            None if top_k in (None, 0) else int(top_k), None if top_p is None else float(top_p))
        return until, int(kwargs.get("max_gen_toks", self.max_gen_toks)), sampling

    def _generate(self, contexts: list[str], until: tuple[str, ...], limit: int, sampling: Sampling,
                  generator: torch.Generator) -> list[str]:
        from mhar_lit.generation import cut_at_stop, generate

        keep = max(1, self.max_length - limit)  # as lm_eval's HF model: the context leaves room for the answer
        prompts = [(self.tokenizer.encode(ctx) or [self.prefix_token_id])[-keep:] for ctx in contexts]
        limit = min(limit, self.max_length - max(len(p) for p in prompts))
        eos = getattr(self.tokenizer, "eos_id", None)
        tokens = generate(self.model, prompts, limit, sampling, generator, eos_ids=() if eos is None else (eos,),
                          stop=until, decode=self.tokenizer.decode)
        return [cut_at_stop(self.tokenizer.decode(t), until) for t in tokens]


def _dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(table)}")
    return table[name]


def build_scorer(path: str, tokenizer: Optional[str] = None, device: Optional[str] = None,
                 dtype: Optional[str] = None, batch_size: int | str = 8, max_length: Optional[int] = None,
                 prefix_token_id: Optional[int] = None, eos: Optional[str] = None, max_gen_toks: int = 256,
                 backend: Optional[str] = None, seed: int = 1234, allow_unverified: bool = False) -> MHARScorer:
    """A converted or exported directory (load_pretrained + tokenizer, default path/tokenizer.json) or a trained
    Lightning .ckpt (its model and the tokenizer its run trained with, read and sha256-verified by the checkpoint
    reader as for `generate`; allow_unverified=true accepts a .ckpt without a sidecar) -> MHARScorer."""
    from mhar_lit.convert import load_pretrained
    from mhar_lit.convert.core import read_mhar_config

    if not Path(path).exists():
        raise UserFileNotFoundError(f"path={path}: neither a checkpoint file nor a converted model directory")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = int(batch_size) if str(batch_size).isdigit() else 8  # lm_eval's "auto" is not supported: use 8
    options = dict(max_length=max_length, batch_size=size, max_gen_toks=max_gen_toks, seed=int(seed),
                   prefix_token_id=None if prefix_token_id is None else int(prefix_token_id))
    if Path(path).is_file():
        from mhar_lit.generation.loading import load_generator

        loaded = load_generator(path, tokenizer=tokenizer, eos=eos, device=device, dtype=_dtype(dtype, device),
                                allow_unverified=str(allow_unverified).lower() in ("1", "true", "yes"))
        if backend is not None and hasattr(loaded.model.residual, "set_routing_backend"):
            loaded.model.residual.set_routing_backend(backend)
        return MHARScorer(loaded.model, _CheckpointTokenizer(loaded), **options)
    tok = TokenizerJSON(tokenizer or Path(path) / "tokenizer.json", eos=eos)
    vocab = (read_mhar_config(Path(path)).get("model_config") or {}).get("vocab_size")
    if vocab is not None and tok.vocab_size > vocab:  # checked before an 8B load; its ids would fail inside torch
        raise ValueError(f"tokenizer {tok.path} has {tok.vocab_size} token ids but the model in {path} has "
                         f"vocab_size {vocab}; pass the model's own tokenizer (tokenizer=PATH)")
    model = load_pretrained(path, device=device, dtype=_dtype(dtype, device), backend=backend)
    return MHARScorer(model, tok, **options)


class _CheckpointTokenizer:
    """The tokenizer a checkpoint's run trained with, behind TokenizerJSON's interface."""

    def __init__(self, loaded) -> None:
        self.loaded, self.eos_id = loaded, loaded.eos_ids[0]
        self.vocab_size = loaded.tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.loaded.encode(text)

    def decode(self, ids) -> str:
        return self.loaded.decode(list(ids))


def _register() -> Optional[type]:
    """Define and register the lm_eval model class when lm_eval is importable (else None)."""
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import model_registry
    except ImportError:
        return None

    class MHARLM(LM):
        """lm_eval model backed by MHARScorer; model_args are build_scorer's keyword arguments."""

        def __init__(self, path: str, max_batch_size: Any = None, **kwargs: Any) -> None:
            super().__init__()
            self.scorer = build_scorer(path, **{k: v for k, v in kwargs.items() if v is not None})
            self._device = self.scorer.device

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: Optional[dict] = None):
            # lm_eval adds its own batch_size/device; values given in --model_args take precedence.
            extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
            return cls(**{**extra, **arg_dict})

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
            from lm_eval.utils import simple_parse_args_string

            return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return self.scorer.loglikelihood([tuple(r.args) for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return self.scorer.generate_until([(r.args[0], r.args[1]) for r in requests])

        @property
        def tokenizer_name(self) -> str:
            return str(self.scorer.tokenizer.path)

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME)(MHARLM)
    return model_registry.get(MODEL_NAME)


MHARLM = _register()


LM_EVAL_HELP = """usage: python -m mhar_lit lm_eval --model mhar_lit --model_args path=DIR[,KEY=V...] --tasks T [...]

Runs lm-evaluation-harness's own command line with the mhar_lit model registered; the flags are lm_eval's
(`python -m mhar_lit lm_eval run --help` lists them). DIR is a directory written by `python -m mhar_lit convert`
(or save_pretrained). --model_args keys: {keys}."""


@exits_on_user_error()
def lm_eval_main(argv: Optional[list[str]] = None) -> int:
    """Run lm_eval's CLI with the mhar_lit model registered (argv as for `lm_eval`)."""
    import inspect
    import sys

    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0] in ("-h", "--help"):
        print(LM_EVAL_HELP.format(keys=", ".join(inspect.signature(build_scorer).parameters)))
        return 0
    if MHARLM is None:
        raise UserError("lm_eval is not installed: pip install lm_eval")
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval"] + words
    cli_evaluate()
    return 0
