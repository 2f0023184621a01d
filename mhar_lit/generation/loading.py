"""A model and its tokenizer for generation, from a Lightning checkpoint or a converted directory.

- `.ckpt` (written by `python -m mhar_lit fit`): model, tokenizer and EOS from mhar_lit.checkpoint.read_checkpoint,
  which verifies the file's sha256 sidecar first (`allow_unverified` accepts a file that has none).
- a converted directory (`python -m mhar_lit convert`): `load_pretrained` plus its `tokenizer.json`; EOS ids
  come from its `generation_config.json` when present (Llama's `<|end_of_text|>` is not a default EOS name).

`tokenizer=` overrides either ("bytes" or a tokenizer.json path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from mhar_lit.checkpoint import build_tokenizer, check_vocabulary
from mhar_lit.data.tokenizer import Tokenizer
from mhar_lit.errors import UserFileNotFoundError


@dataclass
class LoadedModel:
    """A model ready to decode with its tokenizer and the token ids that end a generation."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    data_settings: dict = field(default_factory=dict)  # the run's datamodule settings (a .ckpt records them)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text])[0].tolist()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _generation_config_eos(folder: Path) -> list[int]:
    file = folder / "generation_config.json"
    if not file.is_file():
        return []
    value = json.loads(file.read_text()).get("eos_token_id")
    return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]


def load_generator(source: str, tokenizer: Optional[str] = None, eos: Optional[str | int] = None,
                   device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   allow_unverified: bool = False, trust_pickle: bool = False) -> LoadedModel:
    """Model (eval mode, on device, in dtype) and tokenizer from a .ckpt file or a converted directory."""
    path = Path(source)
    if path.is_dir():
        return _load_directory(path, tokenizer, eos, device, dtype)
    from mhar_lit.checkpoint import read_checkpoint

    if not path.exists():
        raise UserFileNotFoundError(f"{source} is neither a checkpoint file nor a converted model directory")
    contents = read_checkpoint(source, tokenizer=tokenizer, eos=eos, allow_unverified=allow_unverified,
                               trust_pickle=trust_pickle)
    model = contents.model.to(device=device, dtype=dtype)
    return LoadedModel(model.eval(), contents.tokenizer, contents.eos_ids, contents.data_settings)


def _load_directory(path: Path, tokenizer: Optional[str], eos: Optional[str | int], device, dtype) -> LoadedModel:
    from mhar_lit.convert import load_pretrained

    extra_eos = _generation_config_eos(path)
    if tokenizer is None and not (path / "tokenizer.json").is_file():
        raise UserFileNotFoundError(f"{path} has no tokenizer.json: pass --tokenizer PATH")
    spec = tokenizer or str(path / "tokenizer.json")
    tok = build_tokenizer(spec, eos if eos is not None else (extra_eos[0] if extra_eos else None),
                          "--tokenizer" if tokenizer else f"in {path}")
    model = load_pretrained(path, device=device, dtype=dtype)
    check_vocabulary(tok, model)
    eos_ids = tuple(dict.fromkeys([tok.eos_id, *extra_eos]))
    return LoadedModel(model.eval(), tok, eos_ids)
