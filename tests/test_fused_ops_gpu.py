"""DecoderLM.fused_ops on a CUDA device: liger's compiled Triton kernels (not the interpreter of test_fused_ops.py)
through a small model's training gradients, inside a captured step, and in cached decoding (on a GPU machine:
`TRITON_INTERPRET=0 python -m pytest tests/test_fused_ops_gpu.py`: tests/conftest.py otherwise sets the interpreter).

Tolerances are test_fused_ops.py's model tolerances (fp32 2e-6, bf16 4e-2 of the largest entry), whose
reasoning holds on a GPU too: the two paths round at the same places in the forward and differ in the backward
by a few bf16 roundings per op, compounded over the layers."""

import pytest
import torch
import torch.nn.functional as F

from mhar_lit.config import ModelConfig
from mhar_lit.generation import generate
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import FullAttnRes, StandardResidual
from seeds import draw_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 4e-2}
STRATEGIES = pytest.mark.parametrize("strategy", [StandardResidual, lambda: FullAttnRes(heads=4)],
                                     ids=["standard", "full-mhar"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def twin_models(strategy, dtype):
    """The same random weights twice on CUDA, fused_ops off and on."""
    cfg = ModelConfig(vocab_size=512, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                      intermediate_size=512, head_dim=64, max_position_embeddings=256)
    torch.manual_seed(draw_seed())
    plain = DecoderLM(cfg, strategy()).to("cuda", dtype)
    fused = DecoderLM(cfg, strategy()).to("cuda", dtype)
    with torch.no_grad():  # gains away from 1, so that a wrong weight gradient or product shows
        for name, p in plain.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    fused.load_state_dict(plain.state_dict())
    fused.fused_ops = True
    return plain, fused


class _Loss(torch.nn.Module):
    """The model's next-token loss as a module: make_graphed_callables treats a module's parameters as inputs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return F.cross_entropy(self.model(ids).float().flatten(0, 1)[:-1], ids.flatten()[1:])


def relative_error(a, exact):
    return ((a.double() - exact.double()).abs().max() / exact.double().abs().max()).item()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    loss = F.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@DTYPES
@STRATEGIES
def test_fused_ops_train_the_same_on_cuda(strategy, dtype):
    plain, fused = twin_models(strategy, dtype)
    ids = torch.randint(0, 512, (4, 128), device="cuda")
    logits, grads = loss_and_grads(plain, ids)
    fused_logits, fused_grads = loss_and_grads(fused, ids)
    assert fused_grads.keys() == grads.keys()
    errors = {name: relative_error(fused_grads[name], grad) for name, grad in grads.items()}
    print(f"{dtype}: logits {relative_error(fused_logits, logits):.1e}, gradients <= {max(errors.values()):.1e}")
    assert relative_error(fused_logits, logits) <= MODEL_TOLERANCE[dtype]
    assert max(errors.values()) <= MODEL_TOLERANCE[dtype], errors


@STRATEGIES
def test_captured_fused_ops_step_equals_the_eager_one(strategy):
    """make_graphed_callables of forward + backward with fused_ops (bf16): the replay's loss and gradients are the
    eager fused step's, bitwise (the same kernels on the same inputs)."""
    _, fused = twin_models(strategy, torch.bfloat16)
    ids = torch.randint(0, 512, (4, 128), device="cuda")

    _, eager = loss_and_grads(fused, ids)
    graphed = torch.cuda.make_graphed_callables(_Loss(fused), (ids,))
    fused.zero_grad(set_to_none=True)
    graphed(ids).backward()
    torch.cuda.synchronize()
    replayed = {n: p.grad.clone() for n, p in fused.named_parameters() if p.grad is not None}
    assert replayed.keys() == eager.keys()
    assert all(torch.equal(replayed[n], eager[n]) for n in eager)


@STRATEGIES
def test_fused_ops_decode_the_same_greedy_tokens_on_cuda(strategy):
    """fp32 greedy decoding of a left-padded batch with fused_ops, in the captured decode step (mode auto) and
    the eager loop: the plain model's tokens."""
    plain, fused = twin_models(strategy, torch.float32)
    plain.eval(), fused.eval()
    prompts = [[5, 17, 3, 99, 250, 7, 1], [40, 2], [300, 12, 8, 64, 9]]
    expected = generate(plain, prompts, 12, mode="eager", fused_ops=False)
    assert generate(fused, prompts, 12, mode="eager") == expected
    assert generate(fused, prompts, 12, mode="auto") == expected
    assert generate(plain, prompts, 12) == expected  # generate's default on CUDA: fused
    assert not plain.fused_ops  # the model's own setting is back
