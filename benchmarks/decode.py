"""Decode speed of mhar_lit's `generate` against transformers' `generate` in the same run.

    python benchmarks/decode.py --budget-s 540                      the full grid on CUDA, bf16, until the budget
    python benchmarks/decode.py --budget-s 540 --resume             the same again: only the cases not yet in --out
    python benchmarks/decode.py --models qwen3-0.6b-delta-h8 --batches 1 --prompts 128 --new-tokens 128
    python benchmarks/decode.py --dry-run --out /tmp/decode.json    tiny shapes on the CPU (the test runs this)
    python benchmarks/decode.py --compile-step ...                   an experiment: our step compiled, then captured
    python benchmarks/decode.py --plain-ops ...                      ours without liger's RMSNorm, RoPE and SiLU * up
                                                                     (generate's default on CUDA: fused)

Models (random weights, built from configs, nothing downloaded):
- `qwen3-0.6b-delta-h8`: a Qwen3-0.6B-shaped transformers model (28 layers, d 1024, 16 / 8 heads, vocabulary
  151,936), saved and converted with `convert_hf(strategy="delta", heads=8, num_blocks=4)`; its transformers
  peer is the original model.
- `350M-standard`, `350M-mhar-h8`, `1B-standard`, `1B-mhar-h8`: from-scratch DecoderLM of the paper's sizes
  with the standard residual or full MHAR (FullAttnRes, H = 8); their peer is transformers' Qwen3 of the same
  shape (one measurement shared by both strategies of a size).

Per case (model, batch, prompt, new tokens): greedy, no EOS (exactly `new` tokens), random prompt ids, bf16.
tokens/s = batch x new tokens / wall time of one whole `generate` call (prefill, capture and the host loop
included), median of --reps calls after one warm-up call; time to first token = the same with one new token.
Ours runs `generate(mode=--mode)` ("auto": a CUDA graph on CUDA). transformers runs `generate` eagerly with its
dynamic cache, and with its static cache and the decode forward compiled (CompileConfig(fullgraph=True,
mode="reduce-overhead")); the compiled column's warm-up compiles (again for every new batch or cache length).
Cases run in priority order (prompt 128 / 128 new first, then prompt 1,024, then 512 new) so that a budget
cut keeps the most telling ones; `--budget-s` stops before a case that the previous case's duration says would
not fit, and the JSON is rewritten after every case, so a run that is killed still leaves what it measured.
The whole grid (40 cases, the compiled peer recompiling for every batch and cache length) takes several device
calls: `--resume` keeps the cases of --out when it was measured at the same commit, device, versions and settings
(RESUME_IDENTITY; anything else is refused, never overwritten) and measures only the others, each case still with
its peers in the same process; `calls` lists each call's date and the cases it added.

Before timing, each model's greedy tokens in --mode are checked against the eager reference loop
(`same_tokens_as_eager_mode`). JSON (default benchmarks/results/decode.json): commit, device, versions, date,
command, settings, that check and `cases`:
{"model", "batch", "prompt", "new_tokens", "tokens_per_s", "ttft_ms", "transformers_eager_tokens_per_s",
"transformers_compiled_tokens_per_s", "transformers_eager_ttft_ms", "same_greedy_tokens"}; a measurement that
was not made is null. same_greedy_tokens: the rows whose tokens equal transformers' eager ones (bf16: random
models may diverge after near-ties; fp32 identity is a test in tests/test_generation.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import git_state  # noqa: E402
from mhar_lit.config import ModelConfig  # noqa: E402
from mhar_lit.generation import generate  # noqa: E402
from mhar_lit.models.decoder import DecoderLM  # noqa: E402
from mhar_lit.residual import FullAttnRes, StandardResidual  # noqa: E402

QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
                 rms_norm_eps=1e-6)
TINY_QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
MODELS = ("qwen3-0.6b-delta-h8", "350M-standard", "350M-mhar-h8", "1B-standard", "1B-mhar-h8")
DRY_RUN = dict(models=["qwen3-0.6b-delta-h8", "350M-standard", "350M-mhar-h8"], batches=[1, 2], prompts=[8],
               new_tokens=[4], reps=1)


@dataclass
class Contender:
    """One of our models and the transformers model it is compared with (shared between strategies of a size)."""

    name: str
    ours: torch.nn.Module
    peer: torch.nn.Module
    peer_key: str


def qwen3_config(shape: dict[str, Any]):
    import transformers

    cfg = transformers.Qwen3Config(**shape, tie_word_embeddings=True, attn_implementation="sdpa")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    return cfg


def qwen3_like(cfg: ModelConfig):
    """transformers' Qwen3 with the shape of one of our from-scratch configs."""
    return qwen3_config(dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                             intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                             rms_norm_eps=cfg.rms_norm_eps))


def no_eos(model):
    """Generation runs exactly max_new_tokens: no EOS id (random weights may pick any id)."""
    model.generation_config.eos_token_id = None
    return model.eval()


def build_models(names: list[str], device: torch.device, dtype: torch.dtype, tiny: bool,
                 workdir: Path) -> list[Contender]:
    """Our models and their transformers peers, all resident (bf16 on an 80 GB card: ~15 GB for the grid)."""
    import transformers

    from mhar_lit.convert import convert_hf, load_pretrained

    peers: dict[str, torch.nn.Module] = {}
    contenders = []
    for name in names:
        torch.manual_seed(0)
        if name.startswith("qwen3-0.6b"):
            with torch.device(device):
                hf = no_eos(transformers.Qwen3ForCausalLM(qwen3_config(TINY_QWEN3 if tiny else QWEN3_06B)).to(dtype))
            hf.save_pretrained(workdir / "hf")
            convert_hf(workdir / "hf", workdir / "ours", strategy="delta", heads=8 if not tiny else 4, num_blocks=4,
                       overwrite=True)
            ours = load_pretrained(workdir / "ours", device=device, dtype=dtype)
            contenders.append(Contender(name, ours, hf, name))
            continue
        size, _, method = name.partition("-")
        cfg = ModelConfig.from_name("tiny-4l" if tiny else size)
        residual = StandardResidual() if method == "standard" else FullAttnRes(heads=8 if not tiny else 4)
        with torch.device(device):
            ours = DecoderLM(cfg, residual).to(dtype).eval()
            if size not in peers:
                peers[size] = no_eos(transformers.Qwen3ForCausalLM(qwen3_like(cfg)).to(dtype))
        contenders.append(Contender(name, ours, peers[size], size))
    return contenders


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int) -> tuple[float, Any]:
    """(median seconds of `reps` calls after one warm-up call, the last call's result)."""
    result = fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def ours_call(model: torch.nn.Module, prompts: list[list[int]], new: int, mode: str,
              fused_ops: Optional[bool] = None) -> Callable[[], list]:
    return lambda: generate(model, prompts, new, mode=mode, fused_ops=fused_ops)


def peer_call(model: torch.nn.Module, ids: torch.Tensor, new: int, compiled: bool) -> Callable[[], torch.Tensor]:
    from transformers.generation import CompileConfig

    options: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, pad_token_id=0,
                                   attention_mask=torch.ones_like(ids))
    if compiled is None:  # the static cache without compiling (dry run on the CPU)
        options.update(cache_implementation="static", disable_compile=True)
    elif compiled:
        options.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True,
                                                                                    mode="reduce-overhead"))

    @torch.no_grad()
    def call():
        tokens = model.generate(ids, **options)[:, ids.shape[1]:]
        if tokens.shape[1] != new:
            raise RuntimeError(f"transformers generated {tokens.shape[1]} tokens, not {new}")
        return tokens
    return call


def check_tokens(model: torch.nn.Module, mode: str, batch: int = 2, prompt: int = 16, new: int = 16) -> list:
    """Greedy tokens of `mode` on left-padded rows of two lengths: the check of every mode against the eager loop."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt - 5 * row,), generator=gen).tolist()
               for row in range(batch)]
    return generate(model, prompts, new, mode=mode)


def compile_decode_step() -> None:
    """An experiment, not a mode of `generate`: our decode step through inductor (its elementwise work fused)
    before the CUDA graph captures it. One compile per (batch, cache length) of the grid, so the recompile limit
    is raised: past it dynamo would fall back to the eager step without a word."""
    from mhar_lit.generation import decoding

    torch._dynamo.config.recompile_limit = 256
    decoding.decode_step = torch.compile(decoding.decode_step, dynamic=False)


def measure_case(contender: Contender, batch: int, prompt: int, new: int, args, peer_cache: dict) -> dict:
    device = contender.ours.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(batch * 100_003 + prompt)
    vocab = min(contender.ours.config.vocab_size, contender.peer.config.vocab_size)
    ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
    prompts = ids.tolist()
    fused = False if args.plain_ops else None
    seconds, ours_tokens = timed(ours_call(contender.ours, prompts, new, args.mode, fused), device, args.reps)
    first, _ = timed(ours_call(contender.ours, prompts, 1, args.mode, fused), device, args.reps)
    case = {"model": contender.name, "batch": batch, "prompt": prompt, "new_tokens": new,
            "tokens_per_s": batch * new / seconds, "ttft_ms": 1e3 * first}
    key = (contender.peer_key, batch, prompt, new)
    if key not in peer_cache:
        peer_cache[key] = measure_peer(contender.peer, ids.to(device), new, args)
    peer = peer_cache[key]
    case.update({k: v for k, v in peer.items() if k != "tokens"})
    if contender.peer_key == contender.name and peer["tokens"] is not None:  # a converted model: same function
        case["same_greedy_tokens"] = sum(a == b for a, b in zip(ours_tokens, peer["tokens"]))
    else:
        case["same_greedy_tokens"] = None
    return case


def measure_peer(model: torch.nn.Module, ids: torch.Tensor, new: int, args) -> dict:
    batch = ids.shape[0]
    result: dict[str, Any] = {"transformers_eager_tokens_per_s": None, "transformers_eager_ttft_ms": None,
                              "transformers_compiled_tokens_per_s": None, "tokens": None}
    if "eager" in args.peers:
        seconds, tokens = timed(peer_call(model, ids, new, False), ids.device, args.reps)
        first, _ = timed(peer_call(model, ids, 1, False), ids.device, args.reps)
        result.update(transformers_eager_tokens_per_s=batch * new / seconds, transformers_eager_ttft_ms=1e3 * first,
                      tokens=tokens.tolist())
    if "compiled" in args.peers:
        compiled = None if args.dry_run else True
        seconds, _ = timed(peer_call(model, ids, new, compiled), ids.device, args.reps)
        result["transformers_compiled_tokens_per_s"] = batch * new / seconds
    return result


def case_order(models: list[str], batches: list[int], prompts: list[int], new_tokens: list[int]) -> list[tuple]:
    """(model, batch, prompt, new) with the short cases first: prompt, then new tokens, then batch vary slowest."""
    return [(m, b, p, n) for n in sorted(new_tokens) for p in sorted(prompts) for b in sorted(batches) for m in models]


RESUME_IDENTITY = ("commit", "device", "torch", "transformers", "dtype", "mode", "compile_step", "plain_ops", "reps",
                   "dry_run")


def case_key(case: dict) -> tuple:
    return case["model"], case["batch"], case["prompt"], case["new_tokens"]


def settings_differ(earlier: dict, report: dict) -> list[str]:
    """How an earlier report (--resume's --out) was measured otherwise than this one: identity or peers. Its cases
    join this report only where nothing differs; otherwise they are never mixed in or overwritten."""
    differ = [f"{key} {earlier.get(key)!r} there, {report.get(key)!r} here" for key in RESUME_IDENTITY
              if earlier.get(key) != report.get(key)]
    if earlier.get("grid", {}).get("peers") != report["grid"]["peers"]:
        differ.append(f"peers {earlier.get('grid', {}).get('peers')!r} there, {report['grid']['peers']!r} here")
    return differ


def run_cases(order: list[tuple], measure: Callable[..., dict], report: dict, budget_s: Optional[float],
              start: float, save: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> None:
    """Measure the cases in order into report["cases"] (after any it holds), saving after each; stop before a case
    that would end past budget_s seconds from `start` if it lasted as long as the previous one (report["stopped"]
    says so)."""
    last_case_s, total = 0.0, len(report["cases"]) + len(order)
    for case in order:
        if budget_s is not None and clock() - start + last_case_s > budget_s:
            report["stopped"] = f"budget of {budget_s:g} s reached after {len(report['cases'])} of {total} cases"
            return
        case_start = clock()
        report["cases"].append(measure(*case))
        last_case_s = clock() - case_start
        save()
    report["complete"] = True


def environment(device: torch.device, commit: Optional[str]) -> dict[str, Any]:
    import transformers

    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
            "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable] + sys.argv)}
    info.update(git_state(commit))
    return info


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def table(cases: list[dict]) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"{'model':22s} {'B':>3s} {'prompt':>6s} {'new':>4s} {'ours tok/s':>10s} {'ttft ms':>8s} "
             f"{'hf eager':>9s} {'hf compiled':>11s} {'hf ttft':>8s}"]
    for c in cases:
        lines.append(f"{c['model']:22s} {c['batch']:3d} {c['prompt']:6d} {c['new_tokens']:4d} "
                     f"{fmt(c['tokens_per_s'], '10.1f')} {fmt(c['ttft_ms'], '8.1f')} "
                     f"{fmt(c['transformers_eager_tokens_per_s'], '9.1f')} "
                     f"{fmt(c['transformers_compiled_tokens_per_s'], '11.1f')} "
                     f"{fmt(c['transformers_eager_ttft_ms'], '8.1f')}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--prompts", nargs="+", type=int, default=[128, 1024])
    p.add_argument("--new-tokens", nargs="+", type=int, default=[128, 512])
    p.add_argument("--reps", type=int, default=3, help="timed calls per measurement after one warm-up (median)")
    p.add_argument("--peers", nargs="*", default=["eager", "compiled"], choices=["eager", "compiled"],
                   help="which transformers columns to measure (none: ours only)")
    p.add_argument("--mode", default="auto", help="our generate's decode mode (auto: a CUDA graph on CUDA)")
    p.add_argument("--compile-step", action="store_true",
                   help="an experiment: our decode step compiled (inductor) before its capture; checked against "
                        "the eager loop's tokens first")
    p.add_argument("--plain-ops", action="store_true",
                   help="ours with the plain elementwise ops (generate(fused_ops=False)); by default generate runs "
                        "liger-kernel's RMSNorm, RoPE and SiLU * up on CUDA")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop before a case that would end after this many seconds; write what was measured")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    p.add_argument("--resume", action="store_true",
                   help="keep the cases already in --out (same commit, device, versions and settings) and measure "
                        "the rest of the grid")
    p.add_argument("--commit", default=None, help="the commit to record when the tree has no git history")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU (decode mode 'device', the static cache not compiled)")
    args = p.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
        args.mode = "device"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("decode.py: error: no CUDA device (use --dry-run for the CPU check)", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    out = Path(args.out)
    report = {**environment(device, args.commit), "dtype": str(dtype).removeprefix("torch."), "mode": args.mode,
              "compile_step": args.compile_step, "plain_ops": args.plain_ops,
              "dry_run": args.dry_run, "reps": args.reps, "budget_s": args.budget_s,
              "grid": {"models": args.models, "batches": args.batches, "prompts": args.prompts,
                       "new_tokens": args.new_tokens, "peers": args.peers},
              "transformers_compiled": ("static cache, not compiled (dry run)" if args.dry_run else
                                        "static cache, CompileConfig(fullgraph=True, mode='reduce-overhead')"),
              "complete": False, "cases": []}
    order = case_order(args.models, args.batches, args.prompts, args.new_tokens)
    earlier = json.loads(out.read_text()) if args.resume and out.is_file() else {}
    if earlier:
        differ = settings_differ(earlier, report)
        if differ:
            print(f"decode.py: error: --resume: {out} was measured otherwise ({'; '.join(differ)}); pass another --out",
                  file=sys.stderr)
            return 2
        report["cases"] = earlier["cases"]
        done = {case_key(case) for case in report["cases"]}
        order = [case for case in order if case not in done]
        report["same_tokens_as_eager_mode"] = earlier.get("same_tokens_as_eager_mode", {})
    report["calls"] = [*earlier.get("calls", []), {"date": report["date"], "cases_before": len(report["cases"])}]
    models = [name for name in args.models if any(case[0] == name for case in order)]  # only those still to measure
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as workdir:
        contenders = {c.name: c for c in build_models(models, device, dtype, args.dry_run, Path(workdir))}
    report["setup_s"] = time.perf_counter() - start
    eager = {name: check_tokens(c.ours, "eager") for name, c in contenders.items()}  # before any compile
    if args.compile_step:
        compile_decode_step()
    report.setdefault("same_tokens_as_eager_mode", {}).update(
        {name: check_tokens(c.ours, args.mode) == eager[name] for name, c in contenders.items()})
    write(out, report)
    peer_cache: dict = {}

    def measure(model, batch, prompt, new):
        case = measure_case(contenders[model], batch, prompt, new, args, peer_cache)
        gc.collect()
        return case

    run_cases(order, measure, report, args.budget_s, start, lambda: write(out, report))
    report["wall_s"] = time.perf_counter() - start
    write(out, report)
    print(table(report["cases"]))
    print(json.dumps({"out": str(out), "cases": len(report["cases"]), "complete": report["complete"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
