"""Helper script for tests/test_distributed.py: FSDP2 (fully_shard) sharding of DecoderLM on CPU with gloo.

    python tests/fsdp_cpu_run.py OUT.json STRATEGY [STRATEGY ...]

For each strategy in turn: shards every DecoderLayer and the root over 2 CPU processes, runs one
forward/backward on each rank's half of a fixed batch, gathers the full gradients and compares them with a
single-process backward over the whole batch (the losses are means over equal halves, so the sharded gradient
is exactly the average). Writes {strategy: report} to OUT.json. All strategies share one pair of processes:
starting a process group per strategy cost more than the strategies' own work. Lightning's FSDPStrategy
requires CUDA, so this exercises the model's shardability directly.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from mhar_lit.config import ModelConfig
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, HyperConnections, StandardResidual

def on_triton(strategy):
    strategy.set_routing_backend("triton")
    return strategy


STRATEGIES = {
    "standard": StandardResidual,
    "hc": lambda: HyperConnections(dynamic=True),
    "mhar": lambda: FullAttnRes(heads=4, random_query_init=True),
    "block": lambda: BlockAttnRes(heads=4, layers_per_block=1, random_query_init=True),
    "delta": lambda: DeltaAttnRes(heads=4, layers_per_block=1),
    # Fused Triton routing (run with TRITON_INTERPRET=1 on CPU): the chunked full path and the per-call delta path.
    "mhar-triton": lambda: on_triton(FullAttnRes(heads=4, random_query_init=True)),
    "delta-triton": lambda: on_triton(DeltaAttnRes(heads=4, layers_per_block=1)),
}


def build(name: str) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_name("tiny"), STRATEGIES[name]())
    if name.startswith("delta"):  # open the gates so routing gradients are not trivially zero
        with torch.no_grad():
            model.residual.gate.fill_(0.3)
            model.residual.query.normal_()
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(5))


def loss_of(model: DecoderLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def worker(rank: int, world: int, names: list[str], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name in names:
        model = build(name)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model)
        loss = loss_of(model, batch()[rank::world])
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        sharded = all(p.to_local().numel() < p.numel() for p in model.parameters() if p.numel() >= world)
        if rank == 0:
            torch.save({"grads": grads, "sharded": sharded}, f"{out}.{name}.pt")
    dist.destroy_process_group()


def report(name: str, out: str) -> dict:
    """The sharded gradients of `name` against a single-process backward over the whole batch."""
    reference = build(name)
    loss_of(reference, batch()).backward()
    got = torch.load(f"{out}.{name}.pt")
    errors = {n: ((got["grads"][n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
              for n, p in reference.named_parameters()}
    return {"max_rel_grad_err": max(errors.values()), "sharded": got["sharded"], "params": len(errors)}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    unknown = sorted(set(names) - set(STRATEGIES))
    if not names or unknown:
        raise SystemExit(f"usage: fsdp_cpu_run.py OUT.json STRATEGY...; strategies: {', '.join(STRATEGIES)}"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    port = 29500 + (os.getpid() % 1000)
    mp.spawn(worker, args=(2, names, port, out), nprocs=2)
    with open(out, "w") as fh:
        json.dump({name: report(name, out) for name in names}, fh)


if __name__ == "__main__":
    main()
