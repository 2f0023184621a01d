"""Which parameters a `bf16-true` run can move at all: AdamW steps of about lr that are under half a bf16 ulp of a
weight round back to the weight. Trains one model twice from the same initial weights on the same batches:
bf16 weights and AdamW state (`bf16-true`, the paper recipes), and fp32 weights with bf16 autocast (`bf16-mixed`),
at constant learning rates, and reports per kind of parameter (RMSNorm gains, which start at 1.0; the strategy's
routing parameters; every other matrix and embedding) the fraction of entries that moved from their initial value.

    python benchmarks/lost_updates.py [--size tiny] [--lrs 5e-4 1e-3] [--steps 50] [--out lost_updates.json]
    python benchmarks/lost_updates.py --size 100M --device cuda --steps 20      (the paper's shape, on a GPU)

Why: the spacing of bf16 just below 1.0 is 2^-8 and just above it 2^-7, so a step under 2^-9 (1.95e-3) leaves a
gain of 1.0 where it is, and AdamW's steps are about lr (5e-4 in the paper recipes, 1e-3 in the study) while they
last. The batches are random tokens (the gradients' signs are what AdamW's step size ignores); the optimizer is
the package's parameter groups in torch's AdamW with the recipes' betas, eps and weight decay.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import git_state  # noqa: E402
from mhar_lit.lit.loss import next_token_loss  # noqa: E402
from mhar_lit.lit.module import LanguageModel  # noqa: E402
from mhar_lit.residual import FullAttnRes  # noqa: E402

PRECISIONS = ("bf16-true", "bf16-mixed")


def parameter_kind(name: str, routing: set[int], param: torch.Tensor) -> str:
    if id(param) in routing:
        return "routing"
    return "norm gain" if "norm" in name and param.dim() == 1 else "other"


def train(size: str, precision: str, lr: float, steps: int, device: torch.device, seed: int) -> dict[str, Any]:
    """`steps` AdamW steps at constant lr on random tokens; the fraction of entries of each kind that moved."""
    torch.manual_seed(seed)
    module = LanguageModel(size=size, residual=FullAttnRes(heads=8 if size != "tiny" else 2), lr=lr).to(device)
    if precision == "bf16-true":
        module = module.to(torch.bfloat16)
    model, hp = module.model, module.hparams
    routing = {id(p) for p in model.residual.routing_parameters()}
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(module.parameter_groups(), lr=lr, betas=tuple(hp.betas), eps=hp.eps)
    vocab = model.config.vocab_size
    batch, length = (2, 64) if size == "tiny" else (2, 512)
    tokens = torch.Generator().manual_seed(seed + 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else \
        contextlib.nullcontext()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, length + 1), generator=tokens).to(device)
        with autocast:
            ce, z = next_token_loss(model, ids[:, :-1], ids[:, 1:], hp.z_loss, False)
        optimizer.zero_grad(set_to_none=True)
        (ce + hp.z_loss * z).backward()
        optimizer.step()
    moved: dict[str, list[float]] = {}
    for name, p in model.named_parameters():
        changed = (p.detach() != initial[name]).sum().item()
        counts = moved.setdefault(parameter_kind(name, routing, p), [0.0, 0.0])
        counts[0] += changed
        counts[1] += p.numel()
    return {"precision": precision, "lr": lr, "steps": steps, "final_ce": ce.item(),
            "fraction_moved": {kind: c / n for kind, (c, n) in sorted(moved.items())},
            "entries": {kind: int(n) for kind, (_, n) in sorted(moved.items())}}


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="lost_updates.json")
    p.add_argument("--commit", help="the commit of a tree copied without its git history (recorded as stated)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    report = {"command": shlex.join([sys.executable] + sys.argv), "date": dt.datetime.now().isoformat(timespec="seconds"),
              **git_state(args.commit), "torch": torch.__version__, "device": str(device), "size": args.size,
              "runs": [train(args.size, precision, lr, args.steps, device, args.seed)
                       for lr in args.lrs for precision in PRECISIONS]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    kinds = sorted({k for run in report["runs"] for k in run["fraction_moved"]})
    print(f"{'precision':11s} {'lr':>8s} {'ce':>7s} " + " ".join(f"{k + ' moved':>17s}" for k in kinds))
    for run in report["runs"]:
        print(f"{run['precision']:11s} {run['lr']:8.1e} {run['final_ce']:7.3f} "
              + " ".join(f"{run['fraction_moved'].get(k, float('nan')):17.4f}" for k in kinds))
    return report


if __name__ == "__main__":
    main()
