"""A CPU stand-in for torch.cuda.make_graphed_callables with the semantics the training path depends on:

- gradients: the backward writes the parameters' gradients into static buffers that every call reuses and returns
  `buffer.detach()`, as the real one does (what the captured step must copy before the next replay);
- autocast: the autocast state at capture is the one every replay runs, forward and backward, whatever autocast
  surrounds the replay; autocast's weight cache is refused at capture, as the real one refuses it;
- the capture's graph: the real one keeps its captured forward's outputs with their autograd graph, so the
  parameters' AccumulateGrad nodes of capture time (made on its side stream) outlive it; so does this one.
Outputs that carry no gradient (the fused loss's z, for logging) are left out of the backward."""

import torch


def static_buffer_graphs(loss_module, sample_args, allow_unused_input=False):
    if torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support the autocast caching")
    captured = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    params = [p for p in loss_module.parameters() if p.requires_grad]
    static_grads = [torch.zeros_like(p) for p in params]

    def as_captured():
        if captured is None:
            return torch.autocast("cpu", enabled=False)
        return torch.autocast("cpu", dtype=captured, cache_enabled=False)

    with torch.enable_grad(), as_captured():
        capture_outputs = loss_module(*sample_args)  # kept, graph and all, for as long as the callable lives

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inputs, targets, *weights):
            ctx.save_for_backward(inputs, targets)
            with as_captured():
                out = loss_module(inputs, targets)
            return tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()

        @staticmethod
        def backward(ctx, *grad_outputs):
            inputs, targets = ctx.saved_tensors
            with torch.enable_grad(), as_captured():
                out = loss_module(inputs, targets)
                outs = out if isinstance(out, tuple) else (out,)
                pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs], allow_unused=True)
            for buffer, grad in zip(static_grads, grads):
                buffer.copy_(grad) if grad is not None else buffer.zero_()
            return (None, None, *(b.detach() for b in static_grads))

    def graphed(inputs, targets):
        return Replay.apply(inputs, targets, *params)

    graphed.capture_outputs = capture_outputs
    return graphed


def captured_and_eager_models(monkeypatch):
    """Two identical tiny MHAR models (z-loss on), one on the captured path through this stand-in, one eager."""
    from mhar_lit.lit import cuda_graph
    from mhar_lit.lit.module import LanguageModel
    from mhar_lit.residual import FullAttnRes

    monkeypatch.setattr(cuda_graph, "capture_problems", lambda module: [])
    monkeypatch.setattr(cuda_graph, "check_supported", lambda module: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", static_buffer_graphs)
    torch.manual_seed(0)
    captured = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, warmup_steps=1)
    eager = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, warmup_steps=1, cuda_graph=False)
    eager.load_state_dict(captured.state_dict())
    return captured, eager
