"""`python -m mhar_lit convert`: graft a residual strategy onto a Hugging Face model, or export back.

    python -m mhar_lit convert --from HF_DIR --to OUT_DIR [--strategy delta] [--heads 8] [--num_blocks 8]
                               [--legacy_block_delta] [--no_null_source] [--dtype source|float32|bfloat16]
                               [--max_shard_size 5GB] [--overwrite]
    python -m mhar_lit convert --export_hf --from OUT_DIR --to HF_DIR [--architecture LlamaForCausalLM]

(The hyphenated spellings --num-blocks, --export-hf, ... are accepted too.)
"""

from __future__ import annotations

import argparse
import re
from typing import Optional

from mhar_lit.convert.hf_config import ARCHITECTURES
from mhar_lit.convert.strategies import STRATEGIES
from mhar_lit.command_line import command_parser
from mhar_lit.errors import exits_on_user_error

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class _SizeType:
    """The --max_shard_size type (a class, so that --help names it instead of printing a function's address)."""

    def __call__(self, text: str | int) -> int:
        return text if isinstance(text, int) else parse_size(text)  # jsonargparse also passes the default

    def __repr__(self) -> str:
        return "size, e.g. 5GB"


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes (decimal units as in transformers; KiB/MiB/GiB are binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 5GB, 500MB, 64KiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def build_parser():
    p = command_parser("convert", __doc__)
    p.add_argument("--from", dest="src", required=True, help="source directory")
    p.add_argument("--to", dest="dst", required=True, help="output directory (written atomically)")
    p.add_argument("--export_hf", "--export-hf", action="store_true",
                   help="reverse direction: a StandardResidual mhar_lit directory -> transformers directory")
    p.add_argument("--strategy", choices=STRATEGIES, default="delta", help="the residual strategy to graft")
    p.add_argument("--heads", type=int, default=8, help="routing heads H (delta/full/block)")
    p.add_argument("--num_blocks", "--num-blocks", type=int, default=8,
                   help="blocks of the depth (delta/block); must divide num_hidden_layers")
    p.add_argument("--legacy_block_delta", "--legacy-block-delta", action="store_true",
                   help="the authors' telescoping block bookkeeping (docs/method.md J4), to evaluate their checkpoint")
    p.add_argument("--no_null_source", "--no-null-source", dest="null_source", action="store_false",
                   help="delta without null sources")
    p.add_argument("--dtype", default="source", choices=("source", "float32", "bfloat16", "float16"),
                   help="dtype of the written weights (source keeps each tensor's own)")
    p.add_argument("--architecture", choices=sorted(ARCHITECTURES),
                   help="--export_hf target (default: the source architecture, else Qwen3 iff qk_norm)")
    p.add_argument("--max_shard_size", "--max-shard-size", type=_SizeType(), default="5GB",
                   help="largest safetensors file, e.g. 5GB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return p


@exits_on_user_error(ValueError)  # ConversionError, and a strategy option the model refuses (e.g. heads)
def convert_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from mhar_lit.convert.core import convert_hf, export_hf  # torch import only after argument errors

    if args.export_hf:
        out = export_hf(args.src, args.dst, architecture=args.architecture, dtype=args.dtype,
                        max_shard_bytes=args.max_shard_size, overwrite=args.overwrite)
    else:
        out = convert_hf(args.src, args.dst, strategy=args.strategy, heads=args.heads,
                         num_blocks=args.num_blocks, legacy_block_delta=args.legacy_block_delta,
                         null_source=args.null_source, dtype=args.dtype,
                         max_shard_bytes=args.max_shard_size, overwrite=args.overwrite)
    print(f"convert: wrote {out}")
    return 0
