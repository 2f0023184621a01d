"""A peer trainer's training step next to our baseline's: litgpt's GPT (Qwen3 config) against our DecoderLM.

    python benchmarks/peer_step.py [--sizes 100M 350M 1B] [--variants litgpt litgpt_compile ours ours_graph]
                                   [--rounds 5] [--steps 3] [--warmup 3] [--out peer_step.json]
    python benchmarks/peer_step.py --device cpu --sizes tiny --variants litgpt ours --dtype fp32   (a CPU check)

Both models have our shapes: litgpt's `Config.from_name("Qwen3-0.6B")` with d, layers, heads, kv heads, head
width, FFN, vocabulary (151,936), RoPE base and norm eps set to ours, qk-norm on, and the embedding tied to the LM
head as litgpt's pretrain does with `train.tie_embeddings` (the parameter counts are checked to be equal). Each
step is what the trainer's own loop does, on the same random tokens at the shipped configs' micro-batch and
sequence length (configs/paper/SIZE.yaml), parameters in bf16 ("bf16-true"; litgpt's pretrain defaults
to bf16-mixed), the same fused AdamW (lr 5e-4, betas 0.9/0.95, weight decay 0.1) and global-norm clipping at 1.0:
- litgpt: `loss = chunked_cross_entropy(model(x), y)` (its pretrain loss: 128-token chunks of the bf16 logits),
  backward, clip, step, zero_grad. litgpt_compile: the same with `torch.compile(model)` (pretrain's default).
- ours: LanguageModel's loss (cross-entropy of the fp32-cast logits), backward, clip, step, zero_grad.
  ours_graph: forward and backward captured as CUDA graphs (torch.cuda.make_graphed_callables), the
  `model.cuda_graph: true` path; ours_compile: `model.compile()`, the `model.compile: true` path.
  ours_graph_compile(_fused): `model.compile()`, then captured (inductor's fused kernels replayed from the
  graphs): what compiling the sublayers inside the captured step would gain; the package refuses the pair today.
  ours_fused / ours_graph_fused: ours / ours_graph with the `model.fused_loss: true` loss (the LM head and the
  cross-entropy chunk by chunk, mhar_lit.kernels.linear_cross_entropy; needs liger-kernel).
  ours_fusedops_fused / ours_graph_fusedops_fused: ours_fused / ours_graph_fused with DecoderLM.fused_ops on
  (liger-kernel's Triton RMSNorm, RoPE and SiLU * up in place of the plain elementwise ops): what fewer kernels
  per layer gain in the captured step.

All variants of a size are resident at once and timed in interleaved rounds (each round: `steps` steps of every
variant, CUDA events per step), after `warmup` steps each (compilation and capture happen there); medians per
variant. With --one-per-process each variant runs in a child process of its own, one after the other, and the
report joins them: at 100M on an H100, litgpt's eager step beside our captured plain-loss step (36 GiB of graph
pools) ran out of memory. MFU uses ONE FLOP count for every variant: Lightning's measure_flops of our baseline's forward +
backward on the meta device (it agrees with 6N + 12 L H d T to 1e-4), against get_available_flops of the card,
or --peak-tflops where Lightning has no entry (none for "NVIDIA H200"). litgpt is imported only here, with a
clear message when it is missing. Writes a JSON (after every size) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import git_state  # noqa: E402
from mhar_lit import DecoderLM, ModelConfig  # noqa: E402
from mhar_lit.residual import StandardResidual  # noqa: E402

VARIANTS = ("litgpt", "litgpt_compile", "ours", "ours_compile", "ours_graph", "ours_fused", "ours_graph_fused",
            "ours_graph_compile", "ours_graph_compile_fused", "ours_fusedops_fused", "ours_graph_fusedops_fused")
TINY_SHAPE = {"micro_batch": 2, "seq_len": 64, "model_overrides": {}}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def import_litgpt():
    try:
        import litgpt  # noqa: F401
        from litgpt.model import GPT
        from litgpt.utils import chunked_cross_entropy
    except ImportError as exc:
        raise SystemExit(f"litgpt is not importable ({exc}). Install it (and what it needs that is missing) with "
                         "`pip install litgpt`, or on the GPU machine from the wheels of benchmarks/gpu_wheels_peer.sh; "
                         "or time only our variants with --variants ours ours_graph") from exc
    return GPT, chunked_cross_entropy


def shipped_shape(size: str) -> dict[str, Any]:
    """Micro-batch, sequence length and model overrides of the shipped recipe of a size."""
    if size == "tiny":
        return dict(TINY_SHAPE)
    import yaml

    path = ROOT / "configs" / "paper" / f"{size}.yaml"
    if not path.is_file():
        raise SystemExit(f"no shipped config for size {size!r} ({path}); sizes: 100M, 350M, 1B, tiny")
    config = yaml.safe_load(path.read_text())
    return {"micro_batch": config["data"]["batch_size"], "seq_len": config["data"]["seq_len"],
            "model_overrides": config["model"].get("model_overrides") or {}}


def litgpt_config(cfg: ModelConfig):
    from litgpt import Config

    return Config.from_name(
        "Qwen3-0.6B", n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
        n_query_groups=cfg.num_kv_heads, head_size=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, padded_vocab_size=cfg.vocab_size, block_size=cfg.max_position_embeddings,
        rope_base=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps, norm_qk=cfg.qk_norm)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward + loss FLOPs per token of our baseline (Lightning's measure_flops, meta device)."""
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = DecoderLM(cfg, StandardResidual())
        tokens = torch.zeros(1, seq_len, dtype=torch.long)
    loss = lambda logits: F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())  # noqa: E731
    return measure_flops(model, lambda: model(tokens), loss) / seq_len


def copy_ours_into_litgpt(ours: DecoderLM, peer: torch.nn.Module) -> None:
    """Our weights into litgpt's modules (fused qkv = [q; k; v] rows, fc_1 / fc_2 / proj = gate / up / down)."""
    with torch.no_grad():
        peer.transformer.wte.weight.copy_(ours.embed_tokens.weight)
        peer.transformer.ln_f.weight.copy_(ours.norm.weight)
        for mine, theirs in zip(ours.layers, peer.transformer.h):
            a = mine.self_attn
            theirs.attn.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            pairs = [(theirs.norm_1, mine.input_layernorm), (theirs.norm_2, mine.post_attention_layernorm),
                     (theirs.attn.proj, a.o_proj), (theirs.mlp.fc_1, mine.mlp.gate_proj),
                     (theirs.mlp.fc_2, mine.mlp.up_proj), (theirs.mlp.proj, mine.mlp.down_proj)]
            if a.q_norm is not None:
                pairs += [(theirs.attn.norm_q, a.q_norm), (theirs.attn.norm_k, a.k_norm)]
            for dst, src in pairs:
                dst.weight.copy_(src.weight)


def same_function_error(cfg: ModelConfig, device: torch.device, seq_len: int) -> float:
    """Max |logits_litgpt - logits_ours| / max |logits_ours| with our weights copied into litgpt, in fp32 on one
    sequence: the two trainers train the same function (RoPE, qk-norm, GQA and tying included), so one FLOP
    count serves both. fp32 matmuls differ by summation order only: ~1e-6."""
    GPT, _ = import_litgpt()
    torch.manual_seed(0)
    with torch.device(device):
        ours = DecoderLM(cfg, StandardResidual()).float()
        peer = GPT(litgpt_config(cfg)).float()
        peer.transformer.wte.weight = peer.lm_head.weight
        tokens = torch.randint(0, cfg.vocab_size, (1, min(seq_len, 256)))
    copy_ours_into_litgpt(ours, peer)
    previous, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        with torch.no_grad():
            mine, theirs = ours(tokens), peer(tokens)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    error = ((theirs - mine).abs().max() / mine.abs().max()).item()
    del ours, peer
    return error


# ------------------------------------------------------------------ the trainers

class Trainer:
    """One variant: its model, its optimizer and a `loss(batch)` that is the trainer's own forward + loss."""

    def __init__(self, name: str, model: torch.nn.Module, loss: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device) -> None:
        self.name, self.model, self.loss = name, model, loss
        self.opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                     fused=device.type == "cuda")
        self.times_ms: list[float] = []
        self.losses: list[float] = []

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def build_litgpt(cfg: ModelConfig, compiled: bool) -> tuple[torch.nn.Module, Callable]:
    GPT, chunked_cross_entropy = import_litgpt()
    model = GPT(litgpt_config(cfg))
    model.apply(model._init_weights)
    model.transformer.wte.weight = model.lm_head.weight  # litgpt pretrain's train.tie_embeddings
    forward = torch.compile(model) if compiled else model
    return model, lambda batch: chunked_cross_entropy(forward(batch[:, :-1]), batch[:, 1:])


def pair_loss(model: torch.nn.Module, fused: bool) -> Callable:
    """LanguageModel's training loss of (inputs, targets) without z-loss (next_token_loss), plain or fused."""
    from mhar_lit.lit.loss import next_token_loss

    return lambda inputs, targets: next_token_loss(model, inputs, targets, 0.0, fused)[0]


def ours_loss(model: torch.nn.Module, fused: bool = False) -> Callable:
    loss = pair_loss(model, fused)
    return lambda batch: loss(batch[:, :-1], batch[:, 1:])


class _LossModule(torch.nn.Module):
    """Model + loss of (inputs, targets), the unit torch.cuda.make_graphed_callables captures."""

    def __init__(self, model: torch.nn.Module, fused: bool) -> None:
        super().__init__()
        self.model, self.loss = model, pair_loss(model, fused)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(inputs, targets)


def build(variant: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, sample: torch.Tensor) -> Trainer:
    torch.manual_seed(0)
    with torch.device(device):
        if variant.startswith("litgpt"):
            model, loss = build_litgpt(cfg, compiled=variant == "litgpt_compile")
            model.to(dtype)
        else:
            model = DecoderLM(cfg, StandardResidual()).to(dtype)  # capture needs the final dtype: build, then wrap
            model, loss = wrap_ours(model, variant, sample)
    return Trainer(variant, model, loss, device)


def wrap_ours(model: DecoderLM, variant: str, sample: torch.Tensor) -> tuple[torch.nn.Module, Callable]:
    fused = variant.endswith("_fused")
    model.fused_ops = "_fusedops" in variant  # before any capture: the graphs record the kernels it picks
    if "_compile" in variant:  # in place (DecoderLM.compile), before any capture
        model.compile()
    if not variant.startswith("ours_graph"):
        return model, ours_loss(model, fused)
    if sample.device.type != "cuda":
        raise SystemExit(f"{variant} captures CUDA graphs: it needs --device cuda")
    inputs, targets = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
    graphed = torch.cuda.make_graphed_callables(_LossModule(model, fused), (inputs, targets))
    return model, lambda batch: graphed(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())


# ------------------------------------------------------------------ timing

class StepTimer:
    """Milliseconds of one step: CUDA events on a GPU (the device's own clock), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        if not self.cuda:
            start = time.perf_counter()
            out = fn()
            return 1e3 * (time.perf_counter() - start), out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), out


def time_size(size: str, args, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Every variant of one size resident at once, `warmup` steps each, then `rounds` rounds of `steps` timed
    steps of every variant in turn (the order rotates each round), so that all see the same machine state."""
    shape = shipped_shape(size)
    cfg = ModelConfig.from_name(size, **shape["model_overrides"])
    b, t = shape["micro_batch"], shape["seq_len"]
    if any(v.startswith("litgpt") for v in args.variants):
        shape["litgpt_vs_ours_logit_error"] = same_function_error(cfg, device, t)
        if shape["litgpt_vs_ours_logit_error"] > 1e-4:
            raise SystemExit(f"{size}: litgpt with our weights differs from our model by "
                             f"{shape['litgpt_vs_ours_logit_error']:.2e} (relative): the configs do not match")
    generator = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (b, t + 1), generator=generator).to(device) for _ in range(4)]
    timer = StepTimer(device)
    trainers = []
    for variant in args.variants:
        trainer = build(variant, cfg, device, dtype, batches[0])
        for i in range(args.warmup):
            trainer.losses.append(float(timer(lambda: trainer.step(batches[i % 4]))[1]))
        trainers.append(trainer)
    for r in range(args.rounds):
        for trainer in trainers[r % len(trainers):] + trainers[: r % len(trainers)]:
            for i in range(args.steps):
                ms, loss = timer(lambda: trainer.step(batches[(r * args.steps + i) % 4]))
                trainer.times_ms.append(ms)
                trainer.losses.append(float(loss))
    return report_size(size, cfg, shape, trainers, args, device, dtype)


def report_size(size: str, cfg: ModelConfig, shape: dict, trainers: list[Trainer], args, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    tokens = shape["micro_batch"] * shape["seq_len"]
    fpt = flops_per_token(cfg, shape["seq_len"])
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    counts = {tr.name: sum(p.numel() for p in tr.model.parameters()) for tr in trainers}  # tied weights once
    if len(set(counts.values())) > 1:
        raise SystemExit(f"{size}: the variants' parameter counts differ ({counts}): the shapes do not match")
    variants = {}
    for tr in trainers:
        ms = statistics.median(tr.times_ms)
        variants[tr.name] = {
            "step_ms": ms, "step_ms_min": min(tr.times_ms), "step_ms_max": max(tr.times_ms), "steps_ms": tr.times_ms,
            "tokens_per_s": tokens / (ms / 1e3), "mfu": fpt * tokens / (ms / 1e3) / peak if peak else None,
            "parameters": counts[tr.name], "first_loss": tr.losses[0], "last_loss": tr.losses[-1],
        }
    result = {"size": size, "model": cfg.to_dict(), **shape, "tokens_per_step": tokens, "flops_per_token": fpt,
              "flops_source": "lightning measure_flops of our baseline (fwd+bwd, meta device), one count for all",
              "peak_flops": peak, "peak_flops_source": peak_source, "variants": variants}
    return with_reference_ratios(result)


def with_reference_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Every variant's tokens/s against `ours` (else the first variant), as `vs_<reference>`."""
    variants = result["variants"]
    reference = "ours" if "ours" in variants else next(iter(variants))
    for row in variants.values():
        for key in [k for k in row if k.startswith("vs_")]:
            del row[key]
        row["vs_" + reference] = row["tokens_per_s"] / variants[reference]["tokens_per_s"]
    return {**result, "reference": reference}


def join_variant_reports(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sizes of one-variant reports (children of --one-per-process) as one list, the variants of a size side by
    side; refuses variants of one size whose parameter counts differ (their shapes would not match)."""
    sizes: dict[str, dict[str, Any]] = {}
    for report in reports:
        for result in report["sizes"]:
            joined = sizes.setdefault(result["size"], {**result, "variants": {}})
            joined.update({k: v for k, v in result.items() if k not in joined})  # litgpt's logit check, if any
            joined["variants"].update(result["variants"])
    for size, result in sizes.items():
        counts = {name: row["parameters"] for name, row in result["variants"].items()}
        if len(set(counts.values())) > 1:
            raise SystemExit(f"{size}: the variants' parameter counts differ ({counts}): the shapes do not match")
    return [with_reference_ratios(result) for result in sizes.values()]


def run_one_per_process(args, argv: list[str], out: Path) -> list[dict[str, Any]]:
    """Each variant in a child process of its own (the same arguments, that variant only); their reports joined.
    A child that fails is reported and left out."""
    import subprocess

    reports = []
    for variant in args.variants:
        child_out = out.with_name(f"{out.stem}.{variant}.json")
        child_argv = strip_options(argv, ("--variants", "--out", "--one-per-process"))
        cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv, "--variants", variant, "--out", str(child_out)]
        done = subprocess.run(cmd)
        if done.returncode != 0 or not child_out.exists():
            print(f"variant {variant}: exit {done.returncode}, left out", flush=True)
            continue
        reports.append(json.loads(child_out.read_text()))
        child_out.unlink()
    return join_variant_reports(reports)


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the named options and their values (an option's values run to the next `--` argument)."""
    kept, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg.split("=", 1)[0] in names
        if not skipping:
            kept.append(arg)
    return kept


def peak_flops(device: torch.device, dtype: torch.dtype, fallback_tflops: Optional[float]) -> tuple[Optional[float], str]:
    from lightning.fabric.utilities.throughput import get_available_flops

    found = get_available_flops(device, dtype)
    if found:
        return float(found), "lightning get_available_flops"
    if device.type == "cuda" and fallback_tflops:
        return fallback_tflops * 1e12, "--peak-tflops (Lightning has no entry for this card)"
    return None, "none known for this device"


# ------------------------------------------------------------------ report and command line

def environment(device: torch.device, stated_commit: Optional[str]) -> dict[str, Any]:
    import lightning

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": lightning.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
            "date": dt.datetime.now().isoformat(timespec="seconds"), "command": shlex.join([sys.executable] + sys.argv)}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("triton", "litgpt"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    info.update(git_state(stated_commit))
    return info


def table_text(results: list[dict]) -> str:
    lines = [f"{'size':6s} {'variant':15s} {'ms/step [min, max]':>26s} {'tokens/s':>11s} {'MFU':>6s} {'vs ref':>7s}"]
    for res in results:
        for name, row in res["variants"].items():
            mfu = f"{row['mfu']:.3f}" if row["mfu"] is not None else "-"
            span = f"{row['step_ms']:.2f} [{row['step_ms_min']:.2f}, {row['step_ms_max']:.2f}]"
            lines.append(f"{res['size']:6s} {name:15s} {span:>26s} {row['tokens_per_s']:>11,.0f} {mfu:>6s} "
                         f"{row['vs_' + res['reference']]:>7.3f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["100M", "350M", "1B"], help="100M 350M 1B (shipped shapes), tiny")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["litgpt", "litgpt_compile", "ours", "ours_graph"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps of each variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant before the rounds")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter and compute dtype")
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense peak of the card where Lightning has none (989: bf16 H100 SXM / H200)")
    p.add_argument("--out", default="peer_step.json")
    p.add_argument("--commit", help="the commit of a tree copied without its git history (recorded as stated)")
    p.add_argument("--one-per-process", action="store_true",
                   help="each variant in a child process of its own, one after the other (memory), one report")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps) < 1 or args.warmup < 1:
        p.error("--rounds, --steps and --warmup must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu (with --sizes tiny) for a check of the script")
    if any(v.startswith("litgpt") for v in args.variants):
        import_litgpt()  # fail before any model is built
    report = {**environment(device, args.commit), "dtype": args.dtype, "rounds": args.rounds, "steps": args.steps,
              "warmup": args.warmup, "sizes": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.one_per_process:
        report["sizes"] = run_one_per_process(args, sys.argv[1:] if argv is None else list(argv), out)
        out.write_text(json.dumps(report, indent=1))
        print(f"\n{report['device']}, torch {report['torch']}, litgpt {report['litgpt']}, {args.dtype}; {out}")
        print(table_text(report["sizes"]))
        return report
    for size in args.sizes:
        report["sizes"].append(time_size(size, args, device, DTYPES[args.dtype]))
        out.write_text(json.dumps(report, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(table_text(report["sizes"][-1:]), flush=True)
    print(f"\n{report['device']}, torch {report['torch']}, litgpt {report['litgpt']}, {args.dtype}; {out}")
    print(table_text(report["sizes"]))
    return report


if __name__ == "__main__":
    main()
