"""`python -m mhar_lit.export`: a trained Lightning checkpoint -> a standalone model directory.

    python -m mhar_lit.export --ckpt runs/.../last.ckpt --to exported/ [--dtype bfloat16] [--overwrite]
                              [--format mhar|hf] [--tokenizer bytes|PATH/tokenizer.json] [--trust_checkpoint]
                              [--allow_unverified]

--format mhar (default) works for every residual strategy: the directory loads with mhar_lit.load_pretrained,
the lm-eval adapter (path=DIR) and transformers' AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True), the last without mhar_lit installed. --format hf writes a plain Llama / Qwen3
directory and needs a standard-residual model.
"""

from __future__ import annotations

from typing import Optional

from mhar_lit.command_line import command_parser
from mhar_lit.errors import exits_on_user_error


def build_parser():
    p = command_parser("export", __doc__)
    p.add_argument("--ckpt", required=True, help="a Lightning checkpoint (.ckpt) written by mhar_lit")
    p.add_argument("--to", dest="dst", required=True, help="output directory (written beside, then renamed)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written weights (default: the checkpoint's)")
    p.add_argument("--format", default="mhar", choices=("mhar", "hf"),
                   help="mhar: any strategy, transformers via trust_remote_code; hf: plain Llama / Qwen3 "
                        "(standard residual only)")
    p.add_argument("--tokenizer", help="'bytes' or a tokenizer.json (default: the run's, from the checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--trust_checkpoint", "--trust-checkpoint", action="store_true",
                   help="allow a checkpoint with pickled Python objects (only for files you created)")
    p.add_argument("--allow_unverified", "--allow-unverified", action="store_true",
                   help="accept a checkpoint that has no .sha256 sidecar (a mismatching one is always refused)")
    return p


@exits_on_user_error(ValueError, FileNotFoundError)  # UserError, ConversionError, the tokenizer layer's errors
def export_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from mhar_lit.export.core import export_checkpoint  # torch import only after argument errors

    out = export_checkpoint(args.ckpt, args.dst, dtype=args.dtype, overwrite=args.overwrite, format=args.format,
                            tokenizer=args.tokenizer, trust_pickle=args.trust_checkpoint,
                            allow_unverified=args.allow_unverified)
    print(f"export: wrote {out}")
    return 0
