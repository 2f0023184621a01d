"""CUDA-graph capture of the training forward and backward (LanguageModel(cuda_graph=True)).

At the paper's microbatches the eager steps are host-bound: on an H200 our 1B baseline spends 158 ms per
step on 65 ms of GPU kernels, because every one of ~6,000 kernels costs host time to launch. Captured with
torch.cuda.make_graphed_callables, forward and backward replay as two graph launches: the baseline ran 1.6x
(350M) and 2.3x (1B) faster, full MHAR likewise (benchmarks/results/train_step.md). The optimizer step,
clipping and logging stay eager.

Capture is the default wherever it is valid (`cuda_graph: null`): the first training batch decides, and the
path taken (captured, or eager and why) is logged once, as a log line and as the MLflow tag `train_path`.
`cuda_graph: true` makes an invalid capture an error; `cuda_graph: false` trains eagerly.
What capture needs, checked at the first training batch:
CUDA; no autocast other than bf16 (precision "bf16-true", "bf16-mixed" or "32-true"); no activation
checkpointing (torch.compile is refused by the constructor already); one process (DDP/FSDP with graphs are not
tested here). Routing monitors run their own eager pass, outside the captured forward.

Mixed precision ("bf16-mixed": fp32 parameters, gradients and AdamW state, bf16 matmuls under autocast) is
captured with autocast's weight cache off: a bf16 copy of a weight cached before or during capture would be
read by every replay, never recast from the updated weight, so make_graphed_callables refuses the cache.
Capture runs under an autocast of the trainer's dtype with cache_enabled=False, and the graphs recast every
weight at each replay, as eager autocast does (its cache only saves recasting a weight used twice in one
forward: same values).

A batch of another shape than the first (a last partial batch) runs eagerly on the same parameters, with
a warning the first time: same function, just not replayed.

Gradients: the captured backward writes the parameters' gradients into static buffers that every replay
overwrites. Handed to autograd as they are, a parameter whose .grad is None adopts such a buffer (AccumulateGrad
steals a tensor nobody else holds), and autograd's adds into .grad run in AccumulateGrad nodes whose stream can
be the capture's side stream: make_graphed_callables keeps its captured forward's outputs and their graph, and
the parameters' nodes made there are reused by every later backward (on an H100 with torch 2.11: NaN from the
second optimizer step with 4 microbatches, exact with 1, and torch's warning that "The AccumulateGrad node's
stream does not match"). So parameters are not inputs of the autograd node the training step sees:
`_ReplayIntoGrad` replays the captured backward inside its own backward, on the training stream, and adds the
static gradients into .grad itself (a copy for the first microbatch of a step, an add for the others, one
foreach launch each). No AccumulateGrad node of a parameter runs, and a captured step is the same function as
an eager one for any accumulation: the same adds in the same order.
Since no parameter's AccumulateGrad node runs, a parameter's post-accumulate-grad hooks do not fire on this path
(nothing here uses them; a run that needs them trains with `cuda_graph: false`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from mhar_lit.lit.loss import next_token_loss


class _LossModule(nn.Module):
    """Decoder + cross-entropy (+ z-loss) as one module of (inputs, targets), the unit that is captured: the
    training loss of LanguageModel._loss (plain or fused), ce alone when z_loss is 0."""

    def __init__(self, model: nn.Module, z_loss: float, fused: bool = False) -> None:
        super().__init__()
        self.model, self.z_loss, self.fused = model, z_loss, fused
        self.keep_outputs, self.kept = False, ()  # while capturing: the last call's outputs (the captured ones)

    def forward(self, inputs: Tensor, targets: Tensor):
        ce, z = next_token_loss(self.model, inputs, targets, self.z_loss, self.fused)
        if self.keep_outputs:
            self.kept = (ce, z)
        return (ce, z) if self.z_loss else ce


def _autocast_dtype() -> Optional[torch.dtype]:
    """The dtype of the autocast active here (Lightning's '*-mixed' precisions enter one around training_step)."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _capture_autocast(module):
    """The trainer's autocast with its weight cache off, for capture (see the module docstring); no-op without."""
    dtype = _autocast_dtype()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(module.device.type, dtype=dtype, cache_enabled=False)


def capture_problems(module) -> list[str]:
    """Why `module` (a LanguageModel inside its trainer) cannot be captured; empty if it can."""
    problems = []
    if module.device.type != "cuda":
        problems.append(f"the model is on {module.device}, CUDA graphs need a CUDA device")
    autocast = _autocast_dtype()
    if autocast not in (None, torch.bfloat16):
        problems.append(f"autocast to {autocast} is active (precision '16-mixed'): capture is tested with "
                        "'bf16-mixed', 'bf16-true' and '32-true'")
    if module.model.activation_checkpointing:
        problems.append("activation_checkpointing is on")
    if module._trainer is not None and module.trainer.world_size > 1:
        problems.append(f"{module.trainer.world_size} processes: cuda_graph is tested on one device only")
    return problems


def check_supported(module) -> None:
    """Raise if `module` cannot be captured; see the module docstring."""
    problems = capture_problems(module)
    if problems:
        raise RuntimeError("cuda_graph=True cannot capture this run: " + "; ".join(problems))


def _copies(tensors: list[Tensor]) -> list[Tensor]:
    """New tensors holding `tensors`' values, in one foreach launch (x * 1 is exact in every float dtype)."""
    return list(torch._foreach_mul(tensors, 1.0))


class _ReplayIntoGrad(torch.autograd.Function):
    """The captured loss as one autograd node of (anchor, inputs, targets), parameters not among its inputs: its
    backward replays the captured backward and adds the static gradients into the parameters' .grad itself
    (see the module docstring). `anchor`, a leaf that requires grad, makes the outputs require grad; it gets
    no gradient."""

    @staticmethod
    def forward(ctx, graphs: "GraphedLoss", anchor: Tensor, inputs: Tensor, targets: Tensor):
        ctx.set_materialize_grads(False)
        with torch.enable_grad():
            out = graphs.graphed(inputs, targets)
        ctx.graphs, ctx.outputs = graphs, (out if isinstance(out, tuple) else (out,))
        return tuple(o.detach() for o in ctx.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None and o.requires_grad]
        ctx.outputs = ()
        if pairs:
            graphs = ctx.graphs
            static = torch.autograd.grad([o for o, _ in pairs], graphs.parameters, [g for _, g in pairs],
                                         allow_unused=True)
            graphs.accumulate(static)
        return None, None, None, None


class GraphedLoss:
    """Training loss (ce, z) of a LanguageModel through captured graphs, captured at the first batch.

    required=False (cuda_graph: null): `active` decides once, at the first batch, whether this run can be
    captured, logs the path taken, and training stays eager if it cannot. required=True: a run that cannot be
    captured is an error."""

    def __init__(self, required: bool = True) -> None:
        self.required = required
        self.shape: Optional[torch.Size] = None
        self.graphed: Optional[Callable] = None
        self.parameters: list[Tensor] = []
        self.anchor: Optional[Tensor] = None
        self.eager_batches = 0
        self.decision: Optional[bool] = None

    def active(self, module) -> bool:
        """Whether training batches go through the captured graphs (decided and logged at the first call)."""
        if self.decision is None:
            problems = [] if self.required else capture_problems(module)
            self.decision = not problems
            path = "captured (CUDA graphs)" if self.decision else "eager: " + "; ".join(problems)
            _announce(module, path)
        return self.decision

    def __call__(self, module, batch: Tensor) -> tuple[Tensor, Tensor]:
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.graphed is None:
            self._capture(module, inputs, targets)
        if inputs.shape != self.shape:
            if self.eager_batches == 0:
                warnings.warn(f"cuda_graph: a training batch of shape {tuple(batch.shape)} differs from the "
                              f"captured {(self.shape[0], self.shape[1] + 1)}; such batches run eagerly")
            self.eager_batches += 1
            return module._loss(batch)[:2]
        # static output buffers: callers copy what they keep
        out = _ReplayIntoGrad.apply(self, self.anchor, inputs, targets)
        ce, z = out if len(out) == 2 else (out[0], None)
        return ce, (z if z is not None else ce.new_zeros(()))

    def _capture(self, module, inputs: Tensor, targets: Tensor) -> None:
        check_supported(module)
        loss_module = _LossModule(module.model, module.hparams.z_loss, module.hparams.get("fused_loss", False))
        with _capture_autocast(module):
            # allow_unused_input: a parameter the loss does not reach gets no gradient, as in eager mode
            loss_module.keep_outputs = True
            self.graphed = torch.cuda.make_graphed_callables(loss_module, (inputs, targets), allow_unused_input=True)
        loss_module.keep_outputs = False
        # Free the captured forward's autograd graph, whose parameters' AccumulateGrad nodes were made on the
        # capture stream. With torch 2.11 backward still reaches such nodes (something else keeps them alive) and
        # torch warns once per process that their stream does not match; harmless here: _ReplayIntoGrad reaches
        # them only as autograd.grad's captured inputs, so no add runs in them.
        for output in loss_module.kept:
            output.detach_()
        loss_module.kept = ()
        self.parameters = [p for p in module.model.parameters() if p.requires_grad]
        self.anchor = torch.zeros((), device=inputs.device, requires_grad=True)
        self.shape = inputs.shape

    def accumulate(self, static: tuple[Optional[Tensor], ...]) -> None:
        """Add one captured backward's static gradients into .grad: a copy where .grad is None (the first
        microbatch of a step), an add elsewhere, as AccumulateGrad would do, on the current stream."""
        fresh = [(p, g) for p, g in zip(self.parameters, static) if g is not None and p.grad is None]
        summed = [(p, g) for p, g in zip(self.parameters, static) if g is not None and p.grad is not None]
        if summed:
            torch._foreach_add_([p.grad for p, _ in summed], [g for _, g in summed])
        for (p, _), copy in zip(fresh, _copies([g for _, g in fresh]) if fresh else []):
            p.grad = copy


def _announce(module, path: str) -> None:
    """Say once, at the first training batch, how training steps run (log line, MLflow tag `train_path`)."""
    from lightning.pytorch.loggers import MLFlowLogger
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(f"training steps: {path}")
    if module._trainer is None or module.trainer.global_rank != 0:
        return
    for logger in module.trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.set_tag(logger.run_id, "train_path", path)
