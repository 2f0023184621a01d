"""Time full training steps (forward + backward + fused AdamW) of each method at the paper's sizes.

    python benchmarks/train_step.py [--sizes 100M 350M 1B] [--methods baseline mhar block hf]
                                    [--rounds 4] [--steps 3]

Per (size, method): bf16 parameters and compute (the paper's bf16-true), the paper's per-GPU microbatch
(100M: 8 x 2048, 350M: 4 x 1024, 1B: 2 x 1024), fused AdamW, loss as in LanguageModel. Warm-up steps
first, then CUDA-event timing of each step, the methods of a size interleaved in rounds (see time_size);
reports median ms/step, tokens/s, peak memory and the ratio to our baseline measured in the same process.
"hf" is transformers' Qwen3ForCausalLM of the same shape. A method may carry routing-class keywords, e.g.
"block:pass_tile_elements=2048,pass_warps=4", to time configs against the same baseline in one run.
Writes JSON (device, versions, date, command) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mhar_lit.config import ModelConfig  # noqa: E402
from mhar_lit.models.decoder import DecoderLM  # noqa: E402
from mhar_lit.residual import BlockAttnRes, FullAttnRes, StandardResidual  # noqa: E402
from routing import parse_options  # noqa: E402

MICROBATCH = {"100M": (8, 2048), "350M": (4, 1024), "1B": (2, 1024)}
BLOCK_LAYERS = {"100M": 2, "350M": 3, "1B": 6}  # 6, 8 and 6 blocks (the paper's ceil rule gives the same)


def parse_method(method: str) -> tuple[str, dict]:
    """"block:pass_tile_elements=2048,pass_warps=4" -> ("block", {...}): a method with routing-class keywords
    (integers), so that configs of one method are timed in the same run against the same baseline."""
    name, _, text = method.partition(":")
    return name, parse_options(text, f"method {method!r}")


def build(size: str, method: str, backend: str):
    cfg = ModelConfig.from_name(size)
    method, options = parse_method(method)
    if options and method not in ("mhar", "block"):
        raise SystemExit(f"routing options are for the mhar and block methods, not {method!r}")
    if method == "hf":
        import transformers

        hf_cfg = transformers.Qwen3Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, tie_word_embeddings=True,
            max_position_embeddings=cfg.max_position_embeddings, attn_implementation="sdpa",
        )
        return transformers.Qwen3ForCausalLM(hf_cfg)
    residual = {
        "baseline": lambda: StandardResidual(),
        "mhar": lambda: FullAttnRes(heads=8),
        "single": lambda: FullAttnRes(heads=1),
        "block": lambda: BlockAttnRes(heads=8, layers_per_block=BLOCK_LAYERS[size]),
    }[method]()
    if hasattr(residual, "set_routing_backend"):  # options: the triton router's kernel config fields
        residual.set_routing_backend(backend, (options or None) if backend == "triton" else None)
    return DecoderLM(cfg, residual)


def loss_fn(model, method: str, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if method == "hf":
        logits = model(input_ids=inputs).logits
    else:
        logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def setup(size: str, method: str, backend: str):
    """The bf16 model on the GPU (seed 0) and its fused AdamW."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build(size, method, backend).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return model, opt


class _Loss(torch.nn.Module):
    """Model and loss as one module, for torch.cuda.make_graphed_callables (inputs and targets as arguments)."""

    def __init__(self, model, method: str) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.model, self.method, torch.cat([inputs, targets[:, -1:]], dim=1))


def graph_loss(model, method: str, batch: torch.Tensor):
    """Forward and backward of model + loss captured as CUDA graphs (one replay each per step: no per-kernel
    host cost); returns a callable batch -> loss."""
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    graphed = torch.cuda.make_graphed_callables(_Loss(model, method), (inputs, targets))
    return lambda b: graphed(b[:, :-1].contiguous(), b[:, 1:].contiguous())


def train_step(model, opt, method: str, batch: torch.Tensor, graphed=None) -> torch.Tensor:
    """One full step: forward, backward, clip, optimizer step; returns the loss."""
    loss = graphed(batch) if graphed is not None else loss_fn(model, method, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _timed_step(model, opt, method: str, batch: torch.Tensor, graphed=None) -> tuple[float, torch.Tensor]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loss = train_step(model, opt, method, batch, graphed)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), loss.detach()


def time_size(size: str, methods: list[str], rounds: int, steps: int, warmup: int, backend: str,
              cuda_graph: bool = False) -> list[dict]:
    """All methods of one size resident at once, timed in interleaved rounds (`steps` steps of each method per
    round), so that every method sees the same host conditions: these steps are host-bound and the host's
    speed drifts by 10-20% between and within runs. Peak memory is each method's own: the peak during its
    steps minus the resident state (parameters, optimizer) of the other methods."""
    b, t = MICROBATCH[size]
    runs, failed = {}, []
    for method in methods:
        try:
            before = torch.cuda.memory_allocated()
            model, opt = setup(size, method, backend)
            batches = [torch.randint(0, model.config.vocab_size, (b, t + 1), device="cuda") for _ in range(4)]
            graphed = graph_loss(model, method, batches[0]) if cuda_graph else None
            for step in range(warmup):
                _, loss = _timed_step(model, opt, method, batches[step % 4], graphed)
            runs[method] = {"model": model, "opt": opt, "batches": batches, "times": [], "peak": 0,
                            "graphed": graphed,
                            "resident": torch.cuda.memory_allocated() - before, "loss": float(loss)}
        except Exception as err:  # record and continue: one failing method must not hide the others
            failed.append({"size": size, "method": method, "error": f"{type(err).__name__}: {err}"})
            gc.collect()
            torch.cuda.empty_cache()
    total_resident = sum(run["resident"] for run in runs.values())
    for _ in range(rounds):
        for method, run in runs.items():
            torch.cuda.reset_peak_memory_stats()
            for _ in range(steps):
                ms, loss = _timed_step(run["model"], run["opt"], method, run["batches"][len(run["times"]) % 4],
                                       run["graphed"])
                run["times"].append(ms)
            others = total_resident - run["resident"]
            run["peak"] = max(run["peak"], torch.cuda.max_memory_allocated() - others)
            run["loss"] = float(loss)
    results = []
    for method, run in runs.items():
        ms = statistics.median(run["times"])
        results.append({"size": size, "method": method, "ms_per_step": ms, "tokens_per_s": b * t / ms * 1e3,
                        "peak_mem_gb": run["peak"] / 2**30, "resident_gb": run["resident"] / 2**30,
                        "loss": run["loss"], "step_ms_all": run["times"], "microbatch": [b, t]})
    runs.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return results + failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["100M", "350M", "1B"])
    parser.add_argument("--methods", nargs="+", default=["baseline", "mhar", "block", "hf"])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the methods")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each method per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture forward+backward of model and loss as CUDA graphs (an experiment: removes the "
                             "per-kernel host cost that makes these steps host-bound)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for size in args.sizes:
        for r in time_size(size, args.methods, args.rounds, args.steps, args.warmup, args.backend,
                           args.cuda_graph):
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "step_ms_all"}), flush=True)
    base = {r["size"]: r for r in results if r["method"] == "baseline" and "error" not in r}
    for r in results:
        if "error" not in r and r["size"] in base:
            r["throughput_vs_baseline"] = r["tokens_per_s"] / base[r["size"]]["tokens_per_s"]
            r["memory_vs_baseline"] = r["peak_mem_gb"] / base[r["size"]]["peak_mem_gb"]
    import triton

    report = {
        "benchmark": "train_step", "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "routing_backend": args.backend, "cuda_graph": args.cuda_graph,
        "results": results,
    }
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"train_step_{dt.date.today()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"\n{'size':<6} {'method':<16} {'ms/step':>8} {'tok/s':>9} {'vs base':>8} {'mem GB':>7} {'mem x':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['size']:<6} {r['method']:<16} ERROR {r['error'][:80]}")
            continue
        print(f"{r['size']:<6} {r['method']:<16} {r['ms_per_step']:>8.1f} {r['tokens_per_s']:>9.0f} "
              f"{r.get('throughput_vs_baseline', float('nan')):>8.3f} {r['peak_mem_gb']:>7.1f} "
              f"{r.get('memory_vs_baseline', float('nan')):>6.3f}")


if __name__ == "__main__":
    main()
