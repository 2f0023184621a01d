"""The fast decode paths against their references: grouped attention over the cache vs SDPA with GQA and a
boolean mask, the decode router vs the reference full router, generate on CUDA vs the CPU, the device-side
token loop vs the eager loop (same tokens with EOS, stop strings, sampling), incremental detokenization vs
decoding everything."""

import os

import pytest
import torch
import torch.nn.functional as F
from test_generation import prompts_and_continuations, randomised_model

from mhar_lit.data.tokenizer import ByteTokenizer
from mhar_lit.generation import (
    IncrementalText,
    KVCache,
    Sampling,
    StopMatcher,
    decode_routing,
    generate,
    left_pad,
)
from mhar_lit.generation.cache import fold_mask, grouped_attention
from mhar_lit.generation.routing import DecodeCallRouter, DecodeFullRouter
from mhar_lit.routing.torch_routers import CallRouter, FullRouter


# ---------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("new", [1, 5])
def test_grouped_attention_equals_sdpa_with_gqa_and_a_boolean_mask(heads, kv_heads, new):
    """Folding query groups into the query length computes SDPA(enable_gqa) under the same mask (fp64)."""
    gen = torch.Generator().manual_seed(0)
    b, length, d = 3, 11, 8
    q = torch.randn(b, heads, new, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, length, d, generator=gen, dtype=torch.float64) for _ in range(2))
    keys = torch.arange(length)
    columns = torch.arange(length - new, length)
    valid = keys >= torch.tensor([[0], [3], [6]])  # left padding of 0, 3 and 6 columns
    allowed = (keys <= columns[:, None]) & (valid[:, None, :] | (keys == columns[:, None]))  # [B, T, L]
    bias = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf")).unsqueeze(1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=heads != kv_heads)
    got = grouped_attention(q, k, v, fold_mask(bias, heads // kv_heads))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("heads", [1, 8])
def test_decode_router_equals_the_reference_full_router(dtype, tol, heads):
    """Every site's mixture of the decode router equals the reference router's on the same sources."""
    gen = torch.Generator().manual_seed(heads)
    sites, shape = 9, (2, 3, 16)
    query = torch.randn(sites, shape[-1], generator=gen, dtype=dtype)
    norm = 1 + 0.3 * torch.randn(sites, shape[-1], generator=gen, dtype=dtype)
    outputs = [torch.randn(shape, generator=gen, dtype=dtype) * (1 + s) for s in range(sites)]
    reference, fast = FullRouter(heads, 1e-6), DecodeFullRouter(heads, 1e-6)
    states = [router.begin(outputs[0], query, norm) for router in (reference, fast)]
    for site in range(sites):
        expected, got = reference.route(states[0], site), fast.route(states[1], site)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(fast.sources(states[1], site), reference.sources(states[0], site), rtol=0, atol=0)
        if site + 1 < sites:
            states = [reference.add(states[0], outputs[site + 1]), fast.add(states[1], outputs[site + 1])]


needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2.0 ** -8)])
@pytest.mark.parametrize("heads,width", [(1, 16), (8, 24)])
def test_decode_kernels_route_as_the_float64_mix_of_their_keys(dtype, tol, heads, width):
    """The Triton decode routing (a launch per source added and per site routed), over 21 sites (two blocks of
    its online softmax) and 3-wide heads: each key is the source's normalised row (fp32 to 2e-6, bf16 within one
    rounding), and each site's output the float64 softmax mix of the stored sources under those keys, within one
    rounding of the output (2e-6 for fp32, 2^-8 for bf16); in fp32 it also equals the PyTorch decode router."""
    from mhar_lit.generation.routing import normalized_key

    gen = torch.Generator().manual_seed(heads)
    sites, shape = 21, (2, 3, width)
    query = torch.randn(sites, width, generator=gen)
    norm = 1 + 0.3 * torch.randn(sites, width, generator=gen)
    outputs = [(torch.randn(shape, generator=gen) * (1 + s / 4)).to(dtype) for s in range(sites)]
    kernels, plain = DecodeFullRouter(heads, 1e-6, kernels=True), DecodeFullRouter(heads, 1e-6, kernels=False)
    states = [router.begin(outputs[0], query.to(dtype), norm.to(dtype)) for router in (kernels, plain)]
    w = states[0].weights.double()
    for site in range(sites):
        got = kernels.route(states[0], site)
        values, keys = states[0].values[: site + 1].double(), states[0].keys[: site + 1].double()
        torch.testing.assert_close(keys, normalized_key(states[0].values[: site + 1], 1e-6).double(),
                                   rtol=tol, atol=1e-6)
        logits = torch.einsum("nbthk,hk->nbth", keys.view(site + 1, *shape[:2], heads, -1), w[site])
        expected = torch.einsum("nbth,nbthk->bthk", logits.softmax(0), values.view(site + 1, *shape[:2], heads, -1))
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), expected.reshape(shape), rtol=tol, atol=tol)
        if dtype == torch.float32:
            torch.testing.assert_close(got, plain.route(states[1], site), rtol=2e-6, atol=2e-6)
        if site + 1 < sites:
            states = [kernels.add(states[0], outputs[site + 1]), plain.add(states[1], outputs[site + 1])]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_decode_call_router_equals_the_reference_call_router(dtype, tol):
    """Delta-style calls (a broadcast null row per site, then deltas that persist across sites) give the
    reference's mixtures; a delta is normalised once, found again by identity, and a new tensor at the same
    address is not mistaken for it."""
    gen = torch.Generator().manual_seed(0)
    sites, (b, t, d) = 6, (2, 3, 16)
    query, null = (torch.randn(sites, d, generator=gen, dtype=dtype) for _ in range(2))
    norm = 1 + 0.3 * torch.randn(sites, d, generator=gen, dtype=dtype)
    reference, fast = CallRouter(8, 1e-6), DecodeCallRouter(8, 1e-6, fixed_rows=null)
    for _ in range(2):  # two passes: the second pass's deltas are new tensors
        deltas = []
        for site in range(sites):
            if site % 2 == 0:
                deltas.append(torch.randn(b, t, d, generator=gen, dtype=dtype))
            sources = [null[site].expand(b, t, d), *deltas]
            expected = reference.route(sources, query[site], norm[site])
            torch.testing.assert_close(fast.route(sources, query[site], norm[site]), expected, rtol=tol, atol=tol)
    assert len(fast._row_keys) == sites
    unknown_row = torch.randn(d, generator=gen, dtype=dtype).expand(b, t, d)  # not a row of fixed_rows
    torch.testing.assert_close(fast.route([unknown_row], query[0], norm[0]),
                               reference.route([unknown_row], query[0], norm[0]), rtol=tol, atol=tol)


@needs_interpreter
def test_decode_call_router_on_the_kernel_equals_the_reference_call_router():
    """Call mode's softmax and mix in one launch (the sources and keys stacked first), with the query times its
    key-norm weight taken in the kernel: the reference's mixtures in fp32 (2e-6), also for queries made anew at
    every call (a logit scale), which share addresses between calls."""
    gen = torch.Generator().manual_seed(1)
    sites, (b, t, d) = 6, (2, 3, 24)
    query, null = (torch.randn(sites, d, generator=gen) for _ in range(2))
    norm = 1 + 0.3 * torch.randn(sites, d, generator=gen)
    reference, fast = CallRouter(8, 1e-6), DecodeCallRouter(8, 1e-6, fixed_rows=null, kernels=True)
    deltas = []
    for site in range(sites):
        if site % 2 == 0:
            deltas.append(torch.randn(b, t, d, generator=gen))
        sources = [null[site].expand(b, t, d), *deltas]
        for scale in (1.0, 2.0, 3.0):  # a temporary query per call, as effective_query() makes under a logit scale
            q = query[site] * scale
            torch.testing.assert_close(fast.route(sources, q, norm[site]), reference.route(sources, q, norm[site]),
                                       rtol=2e-6, atol=2e-6)


DECODE_ROUTER_CASES = [("full", 1), ("full", 8), ("delta", 8)]


@pytest.mark.parametrize("dtype,query_std,tol", [(torch.float32, 0.3, 1e-5), (torch.float64, 1.0, 1e-12)])
@pytest.mark.parametrize("name,heads", DECODE_ROUTER_CASES, ids=[f"{n}-H{h}" for n, h in DECODE_ROUTER_CASES])
def test_cached_decoding_with_the_decode_routers_equals_the_full_forward(name, heads, dtype, query_std, tol):
    """Prefill + single-token steps under decode_routing give the training forward's logits."""
    model = randomised_model(name, heads, query_std=query_std, dtype=dtype)
    prompts, continuations = prompts_and_continuations()
    ids, mask = left_pad(prompts)
    width, steps = ids.shape[1], len(continuations[0])
    cache = KVCache.for_model(model, len(prompts), width + steps)
    decode_router = DecodeFullRouter if name == "full" else DecodeCallRouter
    with torch.no_grad():
        with decode_routing(model):
            assert isinstance(model.residual.router, decode_router)
            cache.next_valid = mask
            prefill_logits = model(ids, cache)
            step_logits = [model(torch.tensor([[c[j]] for c in continuations]), cache)[:, 0] for j in range(steps)]
        assert not isinstance(model.residual.router, decode_router)  # the training router is back
        for row, (prompt, cont) in enumerate(zip(prompts, continuations)):
            reference = model(torch.tensor([prompt + cont]))[0]
            cached = torch.cat([prefill_logits[row, width - len(prompt):],
                                torch.stack([s[row] for s in step_logits])])
            assert (cached - reference).abs().max().item() <= tol


@needs_interpreter
@pytest.mark.parametrize("name,heads", DECODE_ROUTER_CASES, ids=[f"{n}-H{h}" for n, h in DECODE_ROUTER_CASES])
def test_cached_decoding_on_the_decode_kernels_equals_the_full_forward(name, heads, monkeypatch):
    """Where the decode kernels apply (CUDA, compiled; declared here, interpreted), prefill and decode steps of
    full and call mode route on them, with the full forward's logits (fp32, 1e-5) and the PyTorch routers' greedy
    tokens."""
    from mhar_lit.generation import routing
    from mhar_lit.kernels import decode_routing

    model = randomised_model(name, heads)
    prompts, _ = prompts_and_continuations()
    expected = generate(model, prompts, 6, mode="eager")
    launches = []
    monkeypatch.setattr(routing, "decode_kernels_apply", lambda x: True)
    monkeypatch.setattr(decode_routing, "route", lambda *a, route=decode_routing.route: launches.append(1) or route(*a))
    test_cached_decoding_with_the_decode_routers_equals_the_full_forward(name, heads, torch.float32, 0.3, 1e-5)
    assert len(launches) > 0
    assert generate(model, prompts, 6, mode="eager") == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,heads", [("standard", None), ("full", 8), ("delta", 8)])
def test_generate_on_cuda_gives_the_cpu_tokens(name, heads):
    """On CUDA (fp32) every loop's greedy tokens for a left-padded batch equal the CPU's eager loop. Full mode's
    Triton router in the prefill failed this on an H100 (NaN logits, every token 0): the prefill routes on the
    decode routers."""
    model = randomised_model(name, heads)
    prompts = [[10, 11, 12], [20], [30, 31, 32, 33, 34]]
    expected = generate(model, prompts, 12, mode="eager")
    model = model.cuda()
    for mode in ("eager", "graph"):
        assert generate(model, prompts, 12, mode=mode) == expected, mode


def test_decode_ops_switch_the_fused_kernels_only_where_asked_and_restore():
    """generate's fused_ops: None keeps a CPU model's plain ops; True and False switch them for the call only."""
    from mhar_lit.generation.decoding import decode_ops

    model = randomised_model("standard", None)
    for asked, during in ((None, False), (True, True), (False, False)):
        with decode_ops(model, asked):
            assert model.fused_ops == during
        assert model.fused_ops is False
    model.fused_ops = True
    with decode_ops(model, None):  # the model's own choice stands
        assert model.fused_ops
    with decode_ops(model, False):
        assert not model.fused_ops
    assert model.fused_ops
    with decode_ops(torch.nn.Linear(2, 2), True):  # not a DecoderLM: nothing to switch
        pass
    model.fused_ops = False
    first_norm = model._fusable_modules()[0]
    first_norm.fused_ops = True  # a mixed setting: one module fused
    with decode_ops(model, False):
        assert not first_norm.fused_ops
    assert [m.fused_ops for m in model._fusable_modules()][:2] == [True, False]


def test_generate_fuses_ops_on_cuda_only_where_triton_compiles(monkeypatch):
    """None means fused on CUDA with liger-kernel installed, except under Triton's interpreter, whose host copies a
    captured decode step cannot hold, and for fp64 weights; never on the CPU."""
    from mhar_lit.generation.decoding import _fused_ops_compile

    pytest.importorskip("liger_kernel")
    for interpret, on_cuda in (("1", False), ("0", True)):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert not _fused_ops_compile(torch.empty(0, dtype=torch.bfloat16))  # the CPU: plain ops
        assert _fused_ops_compile(_cuda_weight(torch.bfloat16)) == on_cuda
        assert not _fused_ops_compile(_cuda_weight(torch.float64))  # liger computes in fp32: fp64 stays plain


def _cuda_weight(dtype: torch.dtype):
    """A stand-in for a CUDA weight: the check reads only its device and dtype (no GPU needed)."""
    return type("Weight", (), {"device": torch.device("cuda"), "dtype": dtype})()


# ---------------------------------------------------------------------------------------------- token loops
LOOP_CASES = [("standard", None), ("full", 8), ("delta", 8), ("block", 1), ("hyper-dynamic", None)]


@pytest.mark.parametrize("name,heads", LOOP_CASES, ids=[n for n, _ in LOOP_CASES])
def test_device_loop_gives_the_eager_loop_tokens(name, heads):
    """The device-side loop (EOS on the device, host reads every few steps) returns the eager loop's tokens:
    greedy and sampled, with EOS and stop strings finishing rows at different steps, for read intervals
    shorter and longer than the run."""
    model = randomised_model(name, heads)
    prompts = [[10, 11, 12], [20], [30, 31, 32, 33, 34]]
    free = generate(model, prompts, 14, mode="eager")
    eos = free[0][4]
    stop = f"{free[2][5]} {free[2][6]}"

    def decode(ids):
        return " ".join(map(str, ids))

    cases = [(Sampling(), dict(eos_ids=[eos], stop=[stop], decode=decode), (3, 32)),
             (Sampling(temperature=1.0, top_k=40), dict(stop=[stop], decode=decode), (3,))]
    for sampling, kwargs, intervals in cases:
        expected = generate(model, prompts, 14, sampling, torch.Generator().manual_seed(5), mode="eager", **kwargs)
        for sync_every in intervals:
            got = generate(model, prompts, 14, sampling, torch.Generator().manual_seed(5), mode="device",
                           sync_every=sync_every, **kwargs)
            assert got == expected, (kwargs, sampling, sync_every)
    assert generate(model, prompts, 14, eos_ids=[eos], mode="device")[0] == free[0][: free[0].index(eos)]


def test_device_loop_streams_at_every_read():
    model = randomised_model("full", 8)
    seen = []
    tokens = generate(model, [[1, 2], [3]], 10, mode="device", sync_every=4,
                      on_step=lambda toks, done: seen.append([len(t) for t in toks]))
    assert seen == [[4, 4], [8, 8], [10, 10]] and [len(t) for t in tokens] == [10, 10]


def test_decode_modes_are_checked():
    model = randomised_model("standard", None)
    with pytest.raises(ValueError, match="'graph' .*needs a CUDA device, the model is on cpu"):
        generate(model, [[1]], 2, mode="graph")
    with pytest.raises(ValueError, match="unknown decode mode 'fast'"):
        generate(model, [[1]], 2, mode="fast")
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        generate(model, [[1]], 2, sync_every=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA device")
def test_graph_loop_gives_the_eager_loop_tokens_on_cuda():
    model = randomised_model("full", 8).cuda()
    prompts = [[10, 11, 12], [20], [30, 31, 32, 33, 34]]
    for sampling in (Sampling(), Sampling(temperature=1.0, top_p=0.9)):
        runs = [generate(model, prompts, 20, sampling, torch.Generator("cuda").manual_seed(2), mode=mode)
                for mode in ("eager", "graph")]
        assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------- text
def test_incremental_text_equals_decoding_everything():
    """Byte tokens with multi-byte characters: the text is the full decode without its incomplete tail."""
    tok = ByteTokenizer()
    data = list("naïve 日本語 text ✓!".encode())
    text = IncrementalText(tok.decode)
    for i, token in enumerate(data, 1):
        text.push(token)
        assert text.text == tok.decode(data[:i]).rstrip("\ufffd")
    cut = IncrementalText(tok.decode)
    for token in data[:8]:  # ends after the first of the 3 bytes of "日"
        cut.push(token)
    assert cut.finish() == "\ufffd" and cut.text == tok.decode(data[:8])


def test_incremental_text_with_a_bpe_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat, déjà vu"] * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ids = tok.encode("the mat sat; déjà vu 日本 the cat").ids
    text = IncrementalText(tok.decode)
    for token in ids:
        text.push(token)
    text.finish()
    assert text.text == tok.decode(ids)


def test_stop_matcher_searches_only_new_text_but_across_pushes():
    matcher = StopMatcher(["\n\n", "END"])
    assert not matcher.found("abc\n")
    assert matcher.found("abc\n\n")
    matcher = StopMatcher(["END"])
    assert [matcher.found(t) for t in ("E", "EN", "ENx", "ENxE", "ENxEND")] == [False, False, False, False, True]


def test_a_full_decode_pass_refuses_a_source_past_its_sites():
    """The kernels' add writes at the slot it is given: the router checks the room first, in both paths."""
    heads, sites, shape = 2, 3, (1, 1, 8)
    query, norm = torch.randn(sites, 8), torch.ones(sites, 8)
    for kernels in (False, True):
        router = DecodeFullRouter(heads, 1e-6, kernels=kernels)
        state = router.begin(torch.randn(shape), query, norm)
        state.count = sites  # every site's source is in (the check reads only the count)
        with pytest.raises(RuntimeError, match="has no room for source 4"):
            router.add(state, torch.randn(shape))
