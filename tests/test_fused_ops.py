"""DecoderLM.fused_ops: liger-kernel's Triton RMSNorm, RoPE and SiLU * up (mhar_lit.kernels.liger_ops) against the
plain ops and against float64, op by op and through a whole tiny model, its training gradients and its KV-cache
decode. On CPU tensors under Triton's interpreter (tests/conftest.py), with three test-only shims
(tests/triton_interpreter.py): float arguments passed as fp32 scalars and libdevice's rsqrt replaced by
triton.language's, which the interpreter lacks, and bf16 arithmetic done as a GPU does it (the interpreter computes
on bf16's bit patterns and truncates fp32 -> bf16).

Errors are max |a - b| / max |exact| (the tests print them with -s), at this file's fixed seeds (2 CPU cores,
Triton 3.8, liger-kernel 0.8.5; the RoPE rows over both cos/sin layouts):

    op        dtype  liger vs plain: y / gradients   liger vs float64   plain vs float64
    RMSNorm   fp32   0 / <= 8.8e-8                   <= 8.4e-8          <= 8.4e-8
              bf16   0 (bitwise) / <= 5.0e-3         <= 2.9e-3          <= 2.9e-3
    SiLU*up   fp32   5.6e-8 / <= 9.6e-8              <= 5.9e-8          <= 1.0e-7
              bf16   0 (bitwise) / <= 3.9e-3         <= 3.1e-3          <= 3.4e-3
    RoPE      fp32   0 / 0 (bitwise)                 <= 6.7e-8          <= 6.7e-8
              bf16   0 / 0 (bitwise)                 <= 4.9e-3          <= 4.9e-3

Over three runs with fresh seeds (MHAR_RANDOM_SEEDS=1) the bf16 gradients reached 7.6e-3 against the plain ops
and 5.6e-3 against float64; fp32 at most 1.6e-7.

Tolerances: fp32 1e-6 (a few ulps of the largest entry: sums in another order, rsqrt as 1 / sqrt). bf16 2^-6:
each side rounds an entry by at most 2^-8 of its size per rounding (half an ulp), and the plain backward rounds
twice where liger keeps fp32 (RMSNorm's dy * weight, SwiGLU's silu), so the two may part by up to ~4 half-ulps of
the largest entry. The bf16 forwards are bitwise the plain ones (asserted): both round at the same places
(RMSNorm: the statistic in fp32, the row cast to bf16 before the weight). On a GPU the compiler may contract a
product and a sum into one FMA: an ulp more at most, within these tolerances.
"""

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mhar_lit.config import ModelConfig
from mhar_lit.generation import KVCache, generate, left_pad
from mhar_lit.models.decoder import DecoderLM, RMSNorm, _RMSNormFunction, apply_rope, fused_ops_apply
from mhar_lit.residual import FullAttnRes, StandardResidual
from seeds import draw_seed
from triton_interpreter import bf16_arithmetic_as_on_a_gpu, interpretable_liger_rms_norm

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs liger's kernels on CPU tensors through Triton's interpreter")

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2**-6}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(autouse=True)
def _interpreted_liger(monkeypatch):
    interpretable_liger_rms_norm(monkeypatch)
    bf16_arithmetic_as_on_a_gpu(monkeypatch)


def relative_error(a, exact):
    return ((a.double() - exact).abs().max() / exact.abs().max()).item()


def outputs_and_grads(fn, inputs, upstream, differentiable):
    """fn's outputs and the gradients of its first `differentiable` inputs for the upstream gradients."""
    leaves = [x.clone().requires_grad_(i < differentiable) for i, x in enumerate(inputs)]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves[:differentiable], [u.to(o.dtype) for u, o in zip(upstream, outs)])
    return [o.detach() for o in outs] + list(grads)


def check_against_plain_and_exact(fused, plain, exact_fn, inputs, upstream, differentiable, dtype, names):
    """liger's op against the plain one and both against float64, all on the same dtype-rounded inputs and
    upstream gradients. Returns liger's and the plain op's outputs and gradients."""
    rounded, upstream = [x.to(dtype) for x in inputs], [u.to(dtype) for u in upstream]
    mine = outputs_and_grads(fused, rounded, upstream, differentiable)
    theirs = outputs_and_grads(plain, rounded, upstream, differentiable)
    exact = outputs_and_grads(exact_fn, [x.double() for x in rounded], upstream, differentiable)
    tol = TOLERANCE[dtype]
    for name, a, b, e in zip(names, mine, theirs, exact):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        errors = relative_error(a, e), relative_error(a, b.double()), relative_error(b, e)
        print(f"{name} {dtype}: liger vs float64 {errors[0]:.1e}, vs plain {errors[1]:.1e}; plain vs float64 "
              f"{errors[2]:.1e}")
        assert errors[0] <= tol and errors[1] <= tol, name
    if dtype == torch.bfloat16:  # same roundings in the forward
        assert torch.equal(mine[0], theirs[0])
    return mine, theirs


# ------------------------------------------------------------------------------------------------- the ops
def plain_rms_norm(x, w):
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@DTYPES
def test_rms_norm_matches_the_plain_one_and_float64(dtype):
    from mhar_lit.kernels import liger_ops

    gen = torch.Generator().manual_seed(draw_seed())
    x = 3 * torch.randn(2, 5, 64, generator=gen)
    w = 1 + 0.3 * torch.randn(64, generator=gen)
    dy = torch.randn(2, 5, 64, generator=gen)
    check_against_plain_and_exact(lambda a, b: liger_ops.rms_norm(a, b, 1e-6),
                                  lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), plain_rms_norm, [x, w], [dy], 2,
                                  dtype, ("y", "dx", "dweight"))


@DTYPES
def test_silu_mul_matches_the_plain_one_and_float64(dtype):
    from mhar_lit.kernels import liger_ops

    gen = torch.Generator().manual_seed(draw_seed())
    gate, up, dc = 2 * torch.randn(2, 5, 48, generator=gen), torch.randn(2, 5, 48, generator=gen), \
        torch.randn(2, 5, 48, generator=gen)
    plain = lambda a, b: F.silu(a) * b  # noqa: E731
    check_against_plain_and_exact(liger_ops.silu_mul, plain, plain, [gate, up], [dc], 2, dtype,
                                  ("y", "dgate", "dup"))


def rope_tables(angles_TD2, per_row: bool, batch: int):
    angles = torch.cat((angles_TD2, angles_TD2), -1)
    if per_row:  # RotaryEmbedding.at's layout: [B, 1, T, D], each row its own positions
        angles = torch.stack([angles * (1 + 0.1 * b) for b in range(batch)]).unsqueeze(1)
    return angles.cos(), angles.sin()


@DTYPES
@pytest.mark.parametrize("per_row", [False, True], ids=["shared-positions", "per-row-positions"])
def test_rope_matches_the_plain_one_and_float64(dtype, per_row):
    """q, k in the decoder's layout (a [B, H, T, D] view of [B, T, H, D] storage), GQA (4 q heads, 2 k heads),
    cos/sin as RotaryEmbedding's forward ([T, D]) or `at` ([B, 1, T, D]) gives them."""
    from mhar_lit.kernels import liger_ops

    gen = torch.Generator().manual_seed(draw_seed())
    b, t, d = 2, 5, 16
    q_BTHD, k_BTHD = torch.randn(b, t, 4, d, generator=gen), torch.randn(b, t, 2, d, generator=gen)
    cos, sin = rope_tables(3 * torch.randn(t, d // 2, generator=gen), per_row, b)
    dq, dk = torch.randn(b, 4, t, d, generator=gen), torch.randn(b, 2, t, d, generator=gen)

    def fused(q, k, c, s):  # the clones stand for the projections' outputs, which liger overwrites
        return liger_ops.rope(q.clone().transpose(1, 2), k.clone().transpose(1, 2), c, s)

    def plain(q, k, c, s):
        return apply_rope(q.transpose(1, 2), c, s), apply_rope(k.transpose(1, 2), c, s)

    mine, theirs = check_against_plain_and_exact(fused, plain, plain, [q_BTHD, k_BTHD, cos, sin], [dq, dk], 2,
                                                 dtype, ("q", "k", "dq", "dk"))
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))  # same products, same roundings


def test_liger_ops_read_nothing_back_to_the_host():
    """CUDA-graph capture refuses a host read; none in the three liger modules we call (a guard for upgrades)."""
    import liger_kernel.ops as ops

    for name in ("rms_norm.py", "rope.py", "swiglu.py"):
        source = (Path(ops.__file__).parent / name).read_text()
        assert not re.search(r"\.item\(\)|\.tolist\(\)|\.cpu\(\)|\.nonzero\(|synchronize\(", source), name


# ------------------------------------------------------------------------------------------------- the switch
def test_the_switch_is_off_by_default_and_set_on_every_fusable_module():
    model = DecoderLM(ModelConfig.from_name("tiny"))
    assert not model.fused_ops
    model.fused_ops = True
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert model.fused_ops and len(norms) == 2 * 4 + 1 and all(m.fused_ops for m in norms)
    assert model.layers[0].self_attn.fused_ops and model.layers[1].mlp.fused_ops
    assert set(model.state_dict()) == set(DecoderLM(ModelConfig.from_name("tiny")).state_dict())


def test_the_plain_path_runs_on_cpu_tensors_without_the_interpreter(monkeypatch):
    """Outside the interpreter CPU tensors take the plain ops: the switch changes nothing there, bitwise."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_name("tiny"))
    ids = torch.randint(0, 320, (2, 9))
    expected = model(ids)
    model.fused_ops = True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused_ops_apply(True, ids) and torch.equal(model(ids), expected)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_ops_apply(True, ids) and not fused_ops_apply(False, ids)


def test_mixed_dtypes_keep_the_plain_ops():
    """bf16 activations with an fp32 gain (bf16-mixed's q/k norms): the plain product is fp32, liger's would be
    bf16, so the plain op runs; a shared dtype takes liger's kernel."""
    norm = RMSNorm(16)
    norm.fused_ops = True
    x = torch.randn(3, 16).bfloat16().requires_grad_()
    y = norm(x)
    assert y.dtype == torch.float32 and type(y.grad_fn).__name__ == "_RMSNormFunctionBackward"
    norm.bfloat16()
    assert type(norm(x).grad_fn).__name__ == "LigerRMSNormFunctionBackward"


def test_language_model_passes_the_option_to_its_decoder():
    from mhar_lit.lit.module import LanguageModel

    module = LanguageModel(size="tiny", fused_ops=True)
    assert module.model.fused_ops and module.hparams.fused_ops
    assert not LanguageModel(size="tiny").model.fused_ops


# ------------------------------------------------------------------------------------------------- the model
def twin_models(strategy, dtype, **overrides):
    torch.manual_seed(draw_seed())
    plain = DecoderLM(ModelConfig.from_name("tiny", **overrides), strategy()).to(dtype)
    fused = DecoderLM(ModelConfig.from_name("tiny", **overrides), strategy()).to(dtype)
    fused.load_state_dict(plain.state_dict())
    with torch.no_grad():  # gains away from 1, so that a wrong weight gradient or product shows
        for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape).to(dtype))
                q.copy_(p)
    fused.fused_ops = True
    return plain, fused


# Measured over four seeds: fp32 logits <= 2.1e-7, gradients <= 8.1e-7 of their largest entry; bf16 logits
# bitwise equal at three seeds (3.3e-3 at one), gradients <= 1.6e-2: the per-op differences of the backward
# compound over 2 layers and the residual stream. Tolerances 2e-6 and 4e-2.
MODEL_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 4e-2}


@DTYPES
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_a_tiny_decoder_trains_the_same_with_fused_ops(dtype, qk_norm):
    """Logits and every parameter's gradient of fused_ops on vs off (standard residual, qk-norm on or off)."""
    plain, fused = twin_models(StandardResidual, dtype, qk_norm=qk_norm)
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(draw_seed()))
    results = []
    for model in (plain, fused):
        logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:]).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits, grads), (fused_logits, fused_grads) = results
    tol = MODEL_TOLERANCE[dtype]
    errors = {name: relative_error(fused_grads[name], grad.double()) for name, grad in grads.items()}
    print(f"{dtype}: logits {relative_error(fused_logits, logits.double()):.1e}, gradients <= "
          f"{max(errors.values()):.1e}")
    assert relative_error(fused_logits, logits.double()) <= tol
    assert all(fused_grads[name].dtype == grad.dtype for name, grad in grads.items())
    assert max(errors.values()) <= tol, errors


def test_decoder_with_fused_ops_under_activation_checkpointing():
    """Recomputed sublayers (liger overwrites its inputs: the recomputation makes them again) give the same
    gradients as without checkpointing."""
    plain, fused = twin_models(StandardResidual, torch.float32)
    fused.train()
    ids = torch.randint(0, 320, (2, 9))
    grads = []
    for checkpointing in (False, True):
        fused.zero_grad()
        fused.activation_checkpointing = checkpointing
        fused(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in fused.parameters()])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(*grads))


@pytest.mark.parametrize("strategy", [StandardResidual, lambda: FullAttnRes(heads=4)], ids=["standard", "full"])
def test_cached_decoding_with_fused_ops_gives_the_same_greedy_tokens(strategy):
    """Prefill of a left-padded batch + single-token steps (RoPE at per-row positions, [B, 1, T, D] tables) with
    fused_ops: each row's logits equal its full forward's to 1e-5 (as tests/test_generation.py asks of the plain
    path; measured 1.4e-6), and greedy `generate` picks the plain model's tokens in the eager and device loops."""
    plain, fused = twin_models(strategy, torch.float32)
    plain.eval(), fused.eval()
    prompts = [[5, 17, 3, 99, 250, 7, 1], [40, 2], [300, 12, 8, 64, 9]]
    continuation = [[11, 23, 42], [7, 7, 7], [310, 1, 0]]
    ids, mask = left_pad(prompts)
    cache = KVCache.for_model(fused, len(prompts), ids.shape[1] + 3)
    with torch.no_grad():
        cache.next_valid = mask
        prefill = fused(ids, cache)
        steps = [fused(torch.tensor([[c[j]] for c in continuation]), cache)[:, 0] for j in range(3)]
        for row, (prompt, cont) in enumerate(zip(prompts, continuation)):
            reference = plain(torch.tensor([prompt + cont]))[0]
            cached = torch.cat([prefill[row, ids.shape[1] - len(prompt):], torch.stack([s[row] for s in steps])])
            error = (cached - reference).abs().max().item()
            print(f"row {row}: cached fused vs full plain logits {error:.1e}")
            assert error <= 1e-5
    expected = generate(plain, prompts, 6, mode="eager")
    assert generate(fused, prompts, 6, mode="eager") == expected
    assert generate(fused, prompts, 6, mode="device") == expected


# ------------------------------------------------------------------------------------------------- the benchmarks
def _load_benchmark(name, monkeypatch):
    """A script of benchmarks/ as a module, registered for the test's duration (its dataclasses look it up)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_peer_step_times_the_fused_ops_variants(tmp_path, monkeypatch):
    """peer_step.py's eager fused-ops variant at the tiny shape (the captured one needs CUDA): the same first step
    loss as the fused-loss variant without fused ops; the captured variant switches the ops on before capture."""
    peer_step = _load_benchmark("peer_step", monkeypatch)
    assert {"ours_fusedops_fused", "ours_graph_fusedops_fused"} <= set(peer_step.VARIANTS)
    report = peer_step.main(["--device", "cpu", "--sizes", "tiny", "--variants", "ours_fused", "ours_fusedops_fused",
                             "--dtype", "fp32", "--rounds", "1", "--steps", "1", "--warmup", "1",
                             "--out", str(tmp_path / "peer.json")])
    variants = report["sizes"][0]["variants"]
    assert variants["ours_fusedops_fused"]["first_loss"] == pytest.approx(variants["ours_fused"]["first_loss"],
                                                                          rel=1e-6)
    model = DecoderLM(ModelConfig.from_name("tiny"))
    with pytest.raises(SystemExit, match="needs --device cuda"):
        peer_step.wrap_ours(model, "ours_graph_fusedops_fused", torch.zeros(2, 9, dtype=torch.long))
    assert model.fused_ops


def test_decode_benchmark_times_generate_with_and_without_fused_ops(tmp_path, monkeypatch):
    """benchmarks/decode.py times generate's default (fused ops on CUDA) or, with --plain-ops, fused_ops=False; the
    fused call decodes the plain call's greedy tokens (here through the interpreter) and leaves the model plain."""
    decode = _load_benchmark("decode", monkeypatch)
    assert decode.parse_args(["--dry-run", "--plain-ops"]).plain_ops and not decode.parse_args([]).plain_ops
    [contender] = decode.build_models(["350M-standard"], torch.device("cpu"), torch.float32, True, tmp_path)
    prompts = [[5, 17, 3, 99], [40, 2]]
    fused = decode.ours_call(contender.ours, prompts, 6, "device", fused_ops=True)()
    assert fused == decode.ours_call(contender.ours, prompts, 6, "eager", fused_ops=False)()
    assert not contender.ours.fused_ops
