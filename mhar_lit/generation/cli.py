"""`python -m mhar_lit generate`: continue a prompt with a trained checkpoint or a converted model.

    python -m mhar_lit generate --ckpt runs/.../last.ckpt --prompt "def main(" --max_new_tokens 200
    python -m mhar_lit generate --ckpt converted/ --prompt_file prompt.txt --temperature 0.8 --top_p 0.95
    echo "import os" | python -m mhar_lit generate --ckpt last.ckpt --prompt - --stop "\\n\\n"
    python -m mhar_lit generate --ckpt last.ckpt --prompts_jsonl prompts.jsonl > completions.jsonl

One prompt streams its continuation to stdout as it is produced (only complete characters; text that could
still become a stop string is held back until it cannot). --prompts_jsonl decodes its prompts as one batch
and writes one JSON line per prompt ({"prompt": ..., "completion": ...}); each input line is a JSON string
or an object with a "prompt" field. --stop takes the escapes \\n \\t \\r \\\\ \\xNN \\uNNNN (so "\\n\\n" stops
at a blank line). Greedy unless --temperature > 0. The decode speed (new tokens per second) goes to stderr
at the end.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional, TextIO

from mhar_lit.command_line import command_parser, non_negative_float, positive_int
from mhar_lit.errors import UserError, UserFileNotFoundError, exits_on_user_error

DTYPES = ("auto", "float32", "bfloat16", "float16")
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", re.DOTALL)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0", '"': '"', "'": "'"}


def decode_escapes(text: str) -> str:
    r"""`\n`, `\t`, `\r`, `\\`, `\0`, `\xNN`, `\uNNNN` in a command-line string -> the characters (other text,
    non-ASCII included, is kept as typed). An unknown escape is an error: it would never match."""

    def one(match: re.Match) -> str:
        code = match.group(1)
        if code[0] in "xu" and len(code) > 1:
            return chr(int(code[1:], 16))
        if code in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[code]
        raise UserError(f"--stop {text!r}: unknown escape \\{code} (use \\n \\t \\r \\\\ \\xNN \\uNNNN)")

    return _ESCAPE.sub(one, text)


def add_model_arguments(p) -> None:
    """The flags that choose and load a model (shared by generate and perplexity)."""
    p.add_argument("--ckpt", required=True,
                   help="a Lightning .ckpt written by `fit`, or a directory written by `convert` / `export`")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--tokenizer", default=None,
                   help="override the tokenizer: 'bytes' or a tokenizer.json path (default: the model's own)")
    p.add_argument("--eos", default=None, help="EOS token (string or id) for a tokenizer.json")
    p.add_argument("--allow_unverified", "--allow-unverified", action="store_true",
                   help="accept a .ckpt that has no .sha256 sidecar (a mismatching one is always refused)")


def build_parser():
    p = command_parser("generate", __doc__)
    add_model_arguments(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text; '-' reads it from stdin")
    source.add_argument("--prompt_file", "--prompt-file", help="a file whose whole text is the prompt")
    source.add_argument("--prompts_jsonl", "--prompts-jsonl",
                        help="a JSONL file of prompts decoded as one batch (a JSON string or {\"prompt\": ...} per "
                             "line); writes one JSON line per prompt")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=positive_int, default=128,
                   help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--top_k", "--top-k", type=positive_int, default=None,
                   help="sample among the k most likely tokens")
    p.add_argument("--top_p", "--top-p", type=float, default=None,
                   help="sample from the smallest set with this probability")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop when the continuation contains this text (repeatable; escapes such as \\n decoded; "
                        "the text is not printed)")
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


def read_prompts_jsonl(path: str) -> list[str]:
    """The prompts of a JSONL file: each non-empty line a JSON string or an object with a "prompt" string."""
    prompts = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except FileNotFoundError:
        raise UserFileNotFoundError(f"--prompts_jsonl {path}: no such file") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise UserError(f"{path}:{number}: expected a JSON string or an object with a \"prompt\" string")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"--prompts_jsonl {path} holds no prompts")
    return prompts


def _read_prompt(args: Any) -> str:
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                return fh.read()
        except FileNotFoundError:
            raise UserFileNotFoundError(f"--prompt_file {args.prompt_file}: no such file") from None
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def device_and_dtype(device: Optional[str], dtype: str):
    import torch

    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:  # torch asserts when built without CUDA
        raise UserError(f"--device {device} is not usable: {str(err).splitlines()[0]}") from None
    if dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, dtype)


def load_model(args: Any):
    """The model and tokenizer of --ckpt (verified by the checkpoint reader) on --device in --dtype."""
    from mhar_lit.generation.loading import load_generator

    device, dtype = device_and_dtype(args.device, args.dtype)
    eos = int(args.eos) if args.eos is not None and str(args.eos).isdigit() else args.eos
    return load_generator(args.ckpt, args.tokenizer, eos, device, dtype, allow_unverified=args.allow_unverified)


def run(args: Any, out: TextIO, err: Optional[TextIO] = None) -> None:
    import torch

    from mhar_lit.generation.decoding import cut_at_stop, generate
    from mhar_lit.generation.sampling import Sampling

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)  # bad values fail before the model loads
    except ValueError as error:
        raise UserError(str(error)) from None
    stop = [decode_escapes(s) for s in args.stop]
    prompts = read_prompts_jsonl(args.prompts_jsonl) if args.prompts_jsonl else [_read_prompt(args)]
    loaded = load_model(args)
    ids = [loaded.encode(p) or [loaded.eos_ids[0]] for p in prompts]  # an empty prompt starts a new document
    stream = None if args.prompts_jsonl else TextStream(loaded.decode, stop, out)
    generator = torch.Generator(device=loaded.model.embed_tokens.weight.device).manual_seed(args.seed)
    on_step = (lambda toks, done: stream.update(toks[0], False)) if stream else None
    start = time.perf_counter()
    tokens = generate(loaded.model, ids, args.max_new_tokens, sampling, generator, loaded.eos_ids, stop,
                      loaded.decode, on_step=on_step)
    seconds = time.perf_counter() - start
    if stream is not None:
        stream.update(tokens[0], True)
        out.write("\n")
    else:
        for prompt, row in zip(prompts, tokens):
            out.write(json.dumps({"prompt": prompt, "completion": cut_at_stop(loaded.decode(row), stop)},
                                 ensure_ascii=False) + "\n")
    out.flush()
    new = sum(len(row) for row in tokens)
    print(f"generate: {new} new tokens in {seconds:.2f} s ({new / max(seconds, 1e-9):,.1f} tokens/s, "
          f"batch {len(prompts)}, prompt and decode)", file=err or sys.stderr)


@exits_on_user_error(ValueError, FileNotFoundError)  # UserError and the tokenizer / conversion layers' errors
def generate_main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    run(args, sys.stdout)
    return 0
