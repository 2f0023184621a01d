"""A model and its tokenizer for generation, from a Lightning checkpoint or a converted directory.

- `.ckpt` (written by `python -m mhar_lit fit`): the model from `model_from_checkpoint`; the tokenizer from
  the datamodule settings Lightning saves in the checkpoint (`datamodule_hyper_parameters`: `tokenizer` is
  "bytes", a tokenizer.json path or "bpe:<vocab>", whose trained file is looked up in the run's `cache_dir`).
- a converted directory (`python -m mhar_lit convert`): `load_pretrained` plus its `tokenizer.json`; EOS ids
  come from its `generation_config.json` when present (Llama's `<|end_of_text|>` is not a default EOS name).

`tokenizer=` overrides either ("bytes" or a tokenizer.json path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from mhar_lit.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, cached_bpe_path


@dataclass
class LoadedModel:
    """A model ready to decode with its tokenizer and the token ids that end a generation."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text])[0].tolist()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _tokenizer_from_spec(spec: str, eos: Optional[str | int], where: str) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r} ({where}) not found: pass --tokenizer bytes or the path of "
                                "the tokenizer.json the model was trained with")
    return HFTokenizer(path, eos=eos)


def checkpoint_tokenizer(ckpt: str, eos: Optional[str | int] = None) -> Tokenizer:
    """The tokenizer recorded in a Lightning checkpoint's datamodule settings (loaded memory-mapped)."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    settings = checkpoint.get("datamodule_hyper_parameters") if isinstance(checkpoint, dict) else None
    if not isinstance(settings, dict) or not settings.get("tokenizer"):
        raise ValueError(f"{ckpt} records no tokenizer (no datamodule settings saved with it): pass --tokenizer "
                         "bytes or the path of the tokenizer.json the model was trained with")
    spec = str(settings["tokenizer"])
    eos = eos if eos is not None else settings.get("eos")
    if spec.startswith("bpe:"):
        try:
            spec = str(cached_bpe_path(spec, settings.get("cache_dir")))
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{ckpt}: {err}: pass --tokenizer PATH") from None
    return _tokenizer_from_spec(spec, eos, f"recorded in {ckpt}")


def _generation_config_eos(folder: Path) -> list[int]:
    file = folder / "generation_config.json"
    if not file.is_file():
        return []
    value = json.loads(file.read_text()).get("eos_token_id")
    return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]


def load_generator(source: str, tokenizer: Optional[str] = None, eos: Optional[str | int] = None,
                   device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Model (eval mode, on device, in dtype) and tokenizer from a .ckpt file or a converted directory."""
    path = Path(source)
    extra_eos: list[int] = []
    if path.is_dir():
        from mhar_lit.convert import load_pretrained

        extra_eos = _generation_config_eos(path)
        if tokenizer is None and not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json: pass --tokenizer PATH")
        spec = tokenizer or str(path / "tokenizer.json")
        tok = _tokenizer_from_spec(spec, eos if eos is not None else (extra_eos[0] if extra_eos else None),
                                   "--tokenizer" if tokenizer else f"in {path}")
        model = load_pretrained(path, device=device, dtype=dtype)
    elif path.is_file():
        from mhar_lit.lit.module import model_from_checkpoint

        tok = _tokenizer_from_spec(tokenizer, eos, "--tokenizer") if tokenizer else checkpoint_tokenizer(source, eos)
        model = model_from_checkpoint(source).to(device=device, dtype=dtype)
    else:
        raise FileNotFoundError(f"{source} is neither a checkpoint file nor a converted model directory")
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} token ids but the model's vocab_size is "
                         f"{model.config.vocab_size}: pass the model's own tokenizer")
    eos_ids = tuple(dict.fromkeys([tok.eos_id, *extra_eos]))
    return LoadedModel(model.eval(), tok, eos_ids)
