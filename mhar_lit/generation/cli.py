"""`python -m mhar_lit generate`: continue a prompt with a trained checkpoint or a converted model.

    python -m mhar_lit generate --ckpt runs/.../last.ckpt --prompt "def main(" --max_new_tokens 200
    python -m mhar_lit generate --ckpt converted/ --prompt_file prompt.txt --temperature 0.8 --top_p 0.95
    echo "import os" | python -m mhar_lit generate --ckpt last.ckpt --prompt - --stop "\\n\\n"

The continuation streams to stdout as it is produced (only complete characters; text that could still
become a stop string is held back until it cannot). Greedy unless --temperature > 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional, TextIO

DTYPES = ("auto", "float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mhar_lit generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True,
                   help="a Lightning .ckpt written by `fit`, or a directory written by `convert`")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text; '-' reads it from stdin")
    source.add_argument("--prompt_file", help="a file whose whole text is the prompt")
    p.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top_p", type=float, default=None, help="sample from the smallest set with this probability")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop when the continuation contains this text (repeatable; the text is not printed)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--tokenizer", default=None,
                   help="override the tokenizer: 'bytes' or a tokenizer.json path (default: the model's own)")
    p.add_argument("--eos", default=None, help="EOS token (string or id) for a tokenizer.json")
    return p


class TextStream:
    """Writes a growing continuation incrementally: complete characters only, stop-string prefixes held back."""

    def __init__(self, decode, stop: Sequence[str], out: TextIO) -> None:
        self.decode, self.stop, self.out = decode, [s for s in stop if s], out
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.written = ""

    def update(self, tokens: list[int], finished: bool) -> None:
        from mhar_lit.generation.decoding import cut_at_stop

        text = cut_at_stop(self.decode(tokens), self.stop)
        if not finished:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence at the end: wait for its other bytes
            text = text[: max(len(self.written), len(text) - self.hold)]
        if text.startswith(self.written) and len(text) > len(self.written):
            self.out.write(text[len(self.written):])
            self.out.flush()
            self.written = text


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as fh:
            return fh.read()
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def _device_and_dtype(device: Optional[str], dtype: str):
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, dtype)


def run(args: argparse.Namespace, out: TextIO) -> None:
    import torch

    from mhar_lit.generation.decoding import generate
    from mhar_lit.generation.loading import load_generator
    from mhar_lit.generation.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p)  # bad values fail before the model loads
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    prompt = _read_prompt(args)
    device, dtype = _device_and_dtype(args.device, args.dtype)
    loaded = load_generator(args.ckpt, args.tokenizer, args.eos, device, dtype)
    ids = loaded.encode(prompt) or [loaded.eos_ids[0]]  # an empty prompt starts a new document (after EOS)
    stream = TextStream(loaded.decode, args.stop, out)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    tokens = generate(loaded.model, [ids], args.max_new_tokens, sampling, generator, loaded.eos_ids, args.stop,
                      loaded.decode, on_step=lambda toks, done: stream.update(toks[0], False))
    stream.update(tokens[0], True)
    out.write("\n")
    out.flush()


def generate_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from mhar_lit.convert.hf_config import ConversionError

    try:
        run(args, sys.stdout)
    except (ValueError, FileNotFoundError, OSError, ConversionError) as err:
        print(f"generate: error: {err}", file=sys.stderr)
        return 1
    return 0
