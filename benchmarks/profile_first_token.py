"""Where the first token's time goes: ours against transformers' eager `generate`, under torch.profiler.

    python benchmarks/profile_first_token.py --out DIR/first_token_profile.json     (CUDA, bf16)
    python benchmarks/profile_first_token.py --dry-run --out /tmp/p.json             (tiny shapes on the CPU)

The decode benchmark (benchmarks/decode.py) measures time to first token as the wall time of `generate` with one
new token; this says whether that time is GPU work or host time between launches. Per (model, batch, prompt):
the wall time of one call (median of --reps after a warm-up), then one profiled call: the number of GPU kernels,
their summed duration (busy time), the host time of the call, and the operators with the most host time and the
most GPU time. busy / wall near 1: the GPU is the limit (fewer bytes or FLOPs would help); far below 1: the host is
(fewer or cheaper launches would). Models as in decode.py (random weights): 350M-standard, 350M-mhar-h8 and the
transformers Qwen3 of their shape.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode import build_models, environment, peer_call, synchronize, timed, write  # noqa: E402
from mhar_lit.generation import generate  # noqa: E402

TOP = 12


def profiled(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One call under the profiler: GPU kernels (count, summed ms), host ms, the top operators by host and GPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        synchronize(device)
        host_ms = 1e3 * (time.perf_counter() - start)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    table = prof.key_averages()

    def top(key: str) -> list[dict[str, Any]]:
        rows = sorted(table, key=lambda e: getattr(e, key, 0.0), reverse=True)[:TOP]
        return [{"op": e.key, "count": e.count, "ms": getattr(e, key, 0.0) / 1e3} for e in rows]

    return {"profiled_ms": host_ms, "kernels": len(kernels), "gpu_busy_ms": busy_ms,
            "cpu_ops": sum(e.count for e in table), "top_host": top("self_cpu_time_total"),
            "top_gpu": top("self_device_time_total") if kernels else []}


def cases(contenders, batches: list[int], prompts: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    peers_done = set()
    for batch in batches:
        for prompt in prompts:
            gen = torch.Generator().manual_seed(batch * 100_003 + prompt)
            for c in contenders:
                device = c.ours.embed_tokens.weight.device
                vocab = min(c.ours.config.vocab_size, c.peer.config.vocab_size)
                ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
                runs = [(c.name, lambda m=c.ours, p=ids.tolist(): generate(m, p, 1))]
                if (c.peer_key, batch, prompt) not in peers_done:
                    peers_done.add((c.peer_key, batch, prompt))
                    runs.append((f"transformers-{c.peer_key}", peer_call(c.peer, ids.to(device), 1, False)))
                for name, fn in runs:
                    row = {"model": name, "batch": batch, "prompt": prompt, "wall_ms": 1e3 * timed(fn, device, reps)[0]}
                    row.update(profiled(fn, device))
                    rows.append(row)
                    print(f"{name:26s} B{batch:<3d} T{prompt:<5d} wall {row['wall_ms']:7.1f} ms  "
                          f"GPU busy {row['gpu_busy_ms']:7.1f} ms  kernels {row['kernels']:5d}  "
                          f"ops {row['cpu_ops']:5d}", flush=True)
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["350M-standard", "350M-mhar-h8"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--prompts", nargs="+", type=int, default=[128, 1024])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, batch 1 and 2, prompt 8")
    args = p.parse_args(argv)
    if args.dry_run:
        args.batches, args.prompts, args.reps = [1, 2], [8], 1
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_first_token.py: error: no CUDA device (use --dry-run for the CPU check)", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    report = {**environment(device, args.commit), "dtype": str(dtype).removeprefix("torch."), "reps": args.reps}
    with tempfile.TemporaryDirectory(prefix="profile-first-token-") as workdir:
        contenders = build_models(args.models, device, dtype, args.dry_run, Path(workdir))
    report["cases"] = cases(contenders, args.batches, args.prompts, args.reps)
    write(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
