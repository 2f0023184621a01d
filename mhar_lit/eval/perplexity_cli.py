"""`python -m mhar_lit perplexity`: the perplexity of a model on a text file.

    python -m mhar_lit perplexity --ckpt runs/.../last.ckpt --text_file held_out.txt [--seq_len 1024]
    python -m mhar_lit perplexity --ckpt exported/ --text_file held_out.txt --batch_size 4 --device cuda

--ckpt is a Lightning .ckpt (sha256-verified by the checkpoint reader; its run's tokenizer) or a directory
written by `convert` / `export`. The file's text is tokenized whole and scored in windows of --seq_len tokens
(default: the sequence length the run trained with, else the model's context) by
mhar_lit.eval.perplexity.perplexity. Prints the token-weighted mean loss, the perplexity and the tokens scored.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from mhar_lit.command_line import command_parser, positive_int
from mhar_lit.errors import UserError, UserFileNotFoundError, exits_on_user_error


def build_parser():
    from mhar_lit.generation.cli import add_model_arguments

    p = command_parser("perplexity", __doc__)
    add_model_arguments(p)
    p.add_argument("--text_file", "--text-file", required=True, help="a UTF-8 text file to score")
    p.add_argument("--seq_len", "--seq-len", type=positive_int, default=None,
                   help="tokens per scored window (default: the training sequence length, else the context)")
    p.add_argument("--batch_size", "--batch-size", type=positive_int, default=8, help="windows per forward")
    return p


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise UserFileNotFoundError(f"--text_file {path}: no such file") from None
    except UnicodeDecodeError as err:
        raise UserError(f"--text_file {path} is not UTF-8 text (byte {err.start})") from None
    if not text.strip():
        raise UserError(f"--text_file {path} is empty: nothing to score")
    return text


def default_seq_len(args: Any, loaded: Any) -> int:
    """--seq_len, else the run's training sequence length (a .ckpt records it), capped by the context."""
    context = loaded.model.config.max_position_embeddings
    if args.seq_len is not None:
        if args.seq_len > context:
            raise UserError(f"--seq_len {args.seq_len} exceeds the model's context of {context} positions")
        return args.seq_len
    return min(int(loaded.data_settings.get("seq_len") or context), context)


@exits_on_user_error(ValueError, FileNotFoundError)
def perplexity_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    text = read_text(args.text_file)  # before the model loads
    from mhar_lit.generation.cli import load_model

    loaded = load_model(args)
    seq_len = default_seq_len(args, loaded)
    from mhar_lit.eval.perplexity import perplexity  # the scoring library function

    result = perplexity(loaded.model, loaded.encode(text), seq_len=seq_len, batch_size=args.batch_size)
    values = result if isinstance(result, dict) else vars(result)
    print(" ".join(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}"
                   for key, value in values.items()))
    return 0


if __name__ == "__main__":
    sys.exit(perplexity_main())
