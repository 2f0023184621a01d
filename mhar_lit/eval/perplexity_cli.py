"""`python -m mhar_lit perplexity`: the perplexity of a model on a text file or a prepared corpus.

    python -m mhar_lit perplexity --ckpt runs/.../last.ckpt --data held_out.txt [--seq_len 1024]
    python -m mhar_lit perplexity --ckpt exported/ --data data_cache/tokens-<fingerprint> --split val

--ckpt is a Lightning .ckpt (read and sha256-verified by the checkpoint reader, with its run's tokenizer) or a
directory written by `convert` / `export`. --data is a UTF-8 text file (`--text_file` is the same flag) or a
prepared corpus folder. The scoring is mhar_lit.eval.perplexity.perplexity's; this command checks its
arguments, calls it and prints the mean loss (nats per token), the perplexity and the tokens scored.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from mhar_lit.command_line import command_parser, positive_int
from mhar_lit.errors import UserError, UserFileNotFoundError, exits_on_user_error

DTYPES = ("auto", "float32", "bfloat16", "float16")


def build_parser():
    p = command_parser("perplexity", __doc__)
    p.add_argument("--ckpt", required=True, help="a Lightning .ckpt written by `fit`, or a converted directory")
    p.add_argument("--data", "--text_file", "--text-file", required=True,
                   help="a UTF-8 text file, or a prepared corpus folder (a litdata split, or one holding --split)")
    p.add_argument("--split", default="val", help="the split folder of a prepared corpus (default val)")
    p.add_argument("--seq_len", "--seq-len", type=positive_int, default=None,
                   help="tokens of context per window (default: the model's context)")
    p.add_argument("--batch_size", "--batch-size", type=positive_int, default=8, help="windows per forward")
    p.add_argument("--max_tokens", "--max-tokens", type=positive_int, default=None,
                   help="score at most this many predicted tokens (the first ones)")
    p.add_argument("--tokenizer", default=None, help="override the tokenizer: 'bytes' or a tokenizer.json path")
    p.add_argument("--eos", default=None, help="EOS token (string or id) for a tokenizer.json")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--allow_unverified", "--allow-unverified", action="store_true",
                   help="read a .ckpt that has no sha256 sidecar (one that does not match is refused always)")
    return p


def check_inputs(ckpt: str, data: str) -> None:
    """What can be refused before a model loads: a missing checkpoint or data path, an empty text file."""
    if not os.path.exists(ckpt):
        raise UserFileNotFoundError(f"--ckpt {ckpt}: neither a checkpoint file nor a converted model directory")
    if not os.path.exists(data):
        raise UserFileNotFoundError(f"--data {data}: no such file or folder")
    if os.path.isfile(data) and os.path.getsize(data) == 0:
        raise UserError(f"--data {data} is empty: nothing to score")


@exits_on_user_error(ValueError, FileNotFoundError)  # the scoring function's bad-argument errors too
def perplexity_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    check_inputs(args.ckpt, args.data)
    from mhar_lit.eval.perplexity import perplexity  # the scoring library function

    eos = int(args.eos) if args.eos is not None and str(args.eos).isdigit() else args.eos
    result = perplexity(args.ckpt, args.data, seq_len=args.seq_len, batch_size=args.batch_size,
                        tokenizer=args.tokenizer, eos=eos, split=args.split, device=args.device, dtype=args.dtype,
                        max_tokens=args.max_tokens, allow_unverified=args.allow_unverified)
    print(f"perplexity {result.perplexity:.4f}  loss {result.loss:.4f} nats/token  {result.tokens} tokens "
          f"({result.windows} windows of {result.seq_len})")
    return 0


if __name__ == "__main__":
    sys.exit(perplexity_main())
