"""What is alive at a training step's memory peak: one step (forward, backward, clip, fused AdamW) per method
with torch's allocator history recorded, replayed to the moment of the peak; prints the peak, the memory
held before the step (parameters, gradients, optimizer state), and the blocks alive at the peak grouped by
the innermost Python frame of the package that allocated them.

    python benchmarks/memory_peak.py [--sizes 350M 1B] [--methods baseline mhar] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import MICROBATCH, setup, train_step  # noqa: E402

OWN_CODE = ("mhar_lit", "benchmarks")


def where(frames: list) -> str:
    """The innermost frame in our code (file:line function), else the innermost Python frame, else '(C++)'."""
    for frame in frames:
        if any(part in frame.get("filename", "") for part in OWN_CODE):
            return f"{os.path.basename(frame['filename'])}:{frame['line']} {frame['name']}"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{os.path.basename(frame['filename'])}:{frame['line']} {frame['name']}"
    return "(C++ / autograd engine)"


def replay(trace: list) -> tuple[int, dict, str]:
    """(peak bytes above the start, live blocks at the peak {addr: (size, where)}, where the peak alloc was)."""
    live, current, peak, at_peak, peak_site = {}, 0, 0, {}, ""
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, where(event.get("frames", [])))
            current += size
            if current > peak:
                peak, at_peak, peak_site = current, dict(live), live[addr][1]
        elif action == "free_completed":  # a block from before the recording frees below the start
            current -= live.pop(addr)[0] if addr in live else size
    return peak, at_peak, peak_site


def measure(size: str, method: str, top: int) -> None:
    model, opt = setup(size, method, "triton")
    b, t = MICROBATCH[size]
    batch = torch.randint(0, model.config.vocab_size, (b, t + 1), device="cuda")
    for _ in range(2):
        train_step(model, opt, method, batch)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    train_step(model, opt, method, batch)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_allocator = torch.cuda.max_memory_allocated()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live, peak_site = replay(trace)
    groups, counts = collections.Counter(), collections.Counter()
    for size_bytes, site in live.values():
        groups[site] += size_bytes
        counts[site] += 1
    gib = 2**30
    print(f"\n{size} {method}: allocator peak {peak_allocator / gib:.3f} GiB = held before the step "
          f"{before / gib:.3f} + step peak {peak / gib:.3f} (replayed); the peak allocation came from {peak_site}")
    for site, size_bytes in groups.most_common(top):
        print(f"  {size_bytes / 2**20:9.1f} MiB x {counts[site]:4d}  {site}")
    del model, opt
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["350M", "1B"])
    parser.add_argument("--methods", nargs="+", default=["baseline", "mhar"])
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for size in args.sizes:
        for method in args.methods:
            measure(size, method, args.top)


if __name__ == "__main__":
    main()
