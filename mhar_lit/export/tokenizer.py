"""The tokenizer of an export: the run's tokenizer.json, or a tokenizer.json equivalent to the byte tokenizer.

The byte tokenizer (ids 0..255 = UTF-8 bytes, 256 = EOS, decode drops ids >= 256 and replaces invalid
UTF-8) is expressed exactly in the `tokenizers` library as a BPE without merges over the 256 byte-level
symbols (the GPT-2 byte <-> character map), a byte-level pre-tokenizer without the word regex, and
`<|endoftext|>` = 256 as a plain vocabulary entry: it is never produced from text (no merge builds it, unlike
an added token, which the library would match in the text), the EOS lookups of mhar_lit's loaders find it
by name, and a Replace decoder erases it before the byte-level decoder, so decoding drops it as
ByteTokenizer.decode does, with or without skip_special_tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

from mhar_lit.data.integrity import write_json_atomic

from mhar_lit.convert.hf_config import ConversionError

BYTE_EOS = "<|endoftext|>"
# Files that describe an HF tokenizer besides tokenizer.json, copied when they sit next to it.
_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of tokenizers' ByteLevel pre-tokenizer)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """The tokenizer.json text of mhar_lit's byte tokenizer (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_level_chars().items()}
    vocab[BYTE_EOS] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(BYTE_EOS, ""), decoders.ByteLevel()])
    _check_bytes(tokenizer)
    return tokenizer.to_str(pretty=True)


def _check_bytes(tokenizer: Any) -> None:
    """Refuse a tokenizers version that would build something other than the byte tokenizer."""
    text = "".join(map(chr, range(1, 128))) + " é 世界 🙂 " + BYTE_EOS
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if ids != list(text.encode("utf-8")) or tokenizer.decode(ids + [256] + ids) != text + text:
        raise ConversionError("this version of the tokenizers library does not reproduce the byte tokenizer")


def tokenizer_config(eos_token: str, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for transformers' AutoTokenizer: the fast tokenizer of tokenizer.json with its EOS
    (without it AutoTokenizer reads config.json, asks to run the model's remote code, and has no eos_token)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "pad_token": eos_token,
            "model_max_length": max_length, "clean_up_tokenization_spaces": False}


def write_tokenizer(spec: str, eos: Optional[str | int], out: Path, vocab_size: int, max_length: int) -> int:
    """Write the tokenizer files into `out` (tokenizer.json, and tokenizer_config.json: the source's own, with
    its chat template, when one lies beside it, else one naming the EOS); returns the EOS id (checked against
    the model's vocabulary)."""
    from mhar_lit.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec, eos=eos)
    except (OSError, ValueError) as err:
        raise ConversionError(f"tokenizer {spec!r}: {err}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConversionError(f"tokenizer {spec!r} has {tokenizer.vocab_size} token ids but the model's vocab_size "
                              f"is {vocab_size}; ids >= {vocab_size} have no embedding")
    if spec == "bytes":
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        write_json_atomic(out / "tokenizer_config.json", tokenizer_config(BYTE_EOS, max_length))
        return tokenizer.eos_id
    source = Path(spec)
    shutil.copy2(source, out / "tokenizer.json")
    for name in _COMPANIONS:
        if (source.parent / name).is_file():
            shutil.copy2(source.parent / name, out / name)
    if not (out / "tokenizer_config.json").is_file():
        from mhar_lit.data.tokenizer import read_tokenizer_json

        eos_token = read_tokenizer_json(source).id_to_token(tokenizer.eos_id)
        write_json_atomic(out / "tokenizer_config.json", tokenizer_config(eos_token, max_length))
    return tokenizer.eos_id
