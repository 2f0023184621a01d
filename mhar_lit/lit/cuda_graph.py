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

Gradient accumulation: the captured backward hands autograd its static gradient buffers, which the next replay
overwrites. A parameter whose .grad is None adopts such a buffer as its .grad (AccumulateGrad steals a tensor
nobody else holds), so with several microbatches per step the next replay would overwrite the running sum and
the add after it would double the last microbatch's gradient. `GraphGradients` gives such a .grad storage of
its own right before the next captured backward (one copy per optimizer step, only when accumulating), so a
captured step is the same function as an eager one for any accumulation.

The stream of the gradient adds: make_graphed_callables warms up and captures on a side stream and keeps the
captured forward's outputs, autograd graph included. That graph holds the parameters' AccumulateGrad nodes,
made on the side stream, and every later backward reuses them: the adds into .grad then run on the side stream,
unordered with the training stream's next replay and allocations (on an H100 with torch 2.11: NaN from the
second optimizer step with 4 microbatches, exact with 1; torch warns that "The AccumulateGrad node's stream does
not match"). `release_capture_graph` detaches those outputs right after capture, so the next forward makes the
nodes on the training stream, and checks that none of the capture's nodes is still alive; if one is (something
else holds the capture's graph), a run that may train eagerly does, and `cuda_graph: true` is an error.
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


class GraphGradients:
    """Keeps parameters' .grad out of a captured graph's static gradient buffers (see the module docstring).

    The buffers' addresses are learnt once, at capture, from one backward through the graphed callable. Right
    before each captured backward (a hook on the loss), a .grad that is such a buffer, adopted by an earlier
    backward of the same optimizer step, is copied into storage of its own, so the replay cannot overwrite it and
    the backward adds into the copy. With one microbatch per step the optimizer has zeroed the gradients (to None)
    by then, and nothing is copied."""

    def __init__(self, graphed: Callable, sample_args: tuple, parameters) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        out = graphed(*sample_args)
        outs = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(outs, self.parameters, [torch.ones_like(o) for o in outs], allow_unused=True)
        self.static = {g.data_ptr() for g in grads if g is not None}
        self.copies = 0

    def before_backward(self, grad: Tensor) -> Tensor:
        """Tensor hook on the captured loss: copy every .grad that aliases a static buffer."""
        for p in self.parameters:
            if p.grad is not None and p.grad.data_ptr() in self.static:
                p.grad = p.grad.clone()
                self.copies += 1
        return grad


_CAPTURE_TAG = "mhar_lit_capture"


def _accumulator(parameter: Tensor):
    """The parameter's AccumulateGrad node: the live one if a graph holds it, else a new one on this stream."""
    with torch.enable_grad():
        return parameter.expand_as(parameter).grad_fn.next_functions[0][0]


def release_capture_graph(captured_outputs: tuple, parameters) -> bool:
    """Free the autograd graph of the captured forward's outputs (see the module docstring); True when none of
    the parameters' AccumulateGrad nodes of that time is still alive, so that backward makes them anew."""
    parameters = [p for p in parameters if p.requires_grad]
    for p in parameters:
        _accumulator(p).metadata[_CAPTURE_TAG] = True  # the node is the capture's while that graph lives
    for output in captured_outputs:
        if output.grad_fn is not None:
            output.detach_()
    return not any(_CAPTURE_TAG in _accumulator(p).metadata for p in parameters)


class GraphedLoss:
    """Training loss (ce, z) of a LanguageModel through captured graphs, captured at the first batch.

    required=False (cuda_graph: null): `active` decides once, at the first batch, whether this run can be
    captured, logs the path taken, and training stays eager if it cannot. required=True: a run that cannot be
    captured is an error."""

    def __init__(self, required: bool = True) -> None:
        self.required = required
        self.shape: Optional[torch.Size] = None
        self.graphed: Optional[Callable] = None
        self.gradients: Optional[GraphGradients] = None
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
            check_supported(module)
            loss_module = _LossModule(module.model, module.hparams.z_loss, module.hparams.get("fused_loss", False))
            with _capture_autocast(module):
                # allow_unused_input: a parameter the loss does not reach gets no gradient, as in eager mode
                loss_module.keep_outputs = True
                self.graphed = torch.cuda.make_graphed_callables(loss_module, (inputs, targets),
                                                                 allow_unused_input=True)
                loss_module.keep_outputs = False
                released = release_capture_graph(loss_module.kept, module.model.parameters())
                loss_module.kept = ()
                if not released:
                    return self._give_up(module, batch)
                self.gradients = GraphGradients(self.graphed, (inputs, targets), module.model.parameters())
            self.shape = inputs.shape
        if inputs.shape != self.shape:
            if self.eager_batches == 0:
                warnings.warn(f"cuda_graph: a training batch of shape {tuple(batch.shape)} differs from the "
                              f"captured {(self.shape[0], self.shape[1] + 1)}; such batches run eagerly")
            self.eager_batches += 1
            return module._loss(batch)[:2]
        out = self.graphed(inputs, targets)  # static output buffers: callers copy what they keep
        ce, z = out if isinstance(out, tuple) else (out, None)
        ce.register_hook(self.gradients.before_backward)
        return ce, (z if z is not None else ce.new_zeros(()))


    def _give_up(self, module, batch: Tensor) -> tuple[Tensor, Tensor]:
        """The capture's graph outlived release_capture_graph: its gradient adds would run on the capture's
        stream. Train eagerly (or refuse, under cuda_graph: true)."""
        reason = ("the captured forward's autograd graph is still held after capture, so gradients would be "
                  "added on the capture stream")
        if self.required:
            raise RuntimeError(f"cuda_graph=True cannot capture this run: {reason}")
        self.graphed, self.decision = None, False
        _announce(module, "eager: " + reason)
        return module._loss(batch)[:2]


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
