"""Generation: KV-cached decoding equals the full forward for every strategy, parity with transformers' greedy
generate, sampling filters and seeds, the `generate` command and the SampleText callback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from subprocess_env import python_path

from mhar_lit.config import ModelConfig
from mhar_lit.generation import (
    KVCache,
    PromptTooLongError,
    Sampling,
    cut_at_stop,
    decode_routing,
    filter_logits,
    generate,
    left_pad,
    next_tokens,
)
from mhar_lit.generation.cli import TextStream, generate_main
from mhar_lit.models.decoder import DecoderLM, apply_rope
from mhar_lit.residual import (
    BlockAttnRes,
    DeltaAttnRes,
    FullAttnRes,
    HyperConnections,
    StandardResidual,
)

REPO = Path(__file__).resolve().parents[1]

STRATEGIES = {
    "standard": lambda h: StandardResidual(),
    "hyper-dynamic": lambda h: HyperConnections(streams=4, dynamic=True),
    "hyper-mhar-code": lambda h: HyperConnections(streams=2, dynamic=False, variant="mhar_code"),
    "full": lambda h: FullAttnRes(heads=h),
    "block": lambda h: BlockAttnRes(heads=h, layers_per_block=2),
    "block-two-phase": lambda h: BlockAttnRes(heads=h, layers_per_block=1, two_phase=True),
    "delta": lambda h: DeltaAttnRes(heads=h, layers_per_block=2),
}
CASES = [(name, h) for name in STRATEGIES for h in ((1, 8) if name in ("full", "block", "block-two-phase", "delta")
                                                    else (None,))]


def randomised_model(name, heads, seed=0, query_std=0.3, dtype=torch.float32):
    """A tiny model whose strategy parameters are random, so that routing is not uniform, and delta gates and
    nulls are open. Against unit-RMS keys a query of std s gives per-head routing logits of std s sqrt(d/H):
    2.4 at H = 1 and 0.85 at H = 8 for the default s = 0.3 (weights e^(+-2.4) apart)."""
    torch.manual_seed(seed)
    model = DecoderLM(ModelConfig.from_name("tiny-4l"), STRATEGIES[name](heads)).eval().to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.residual.named_parameters():
            scale = {"query": query_std, "gate": 1.0, "null": 1.0}.get(pname, 0.1)  # others: around their init
            p.add_(scale * torch.randn(p.shape, generator=gen).to(dtype))
    return model


def prompts_and_continuations(lengths=(7, 2, 5), steps=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    return prompts, [torch.randint(0, 320, (steps,), generator=gen).tolist() for _ in lengths]


# Tolerance in fp32: 1e-5 on logits of order 1. The cached path does the same arithmetic on other shapes (a
# left-padded batch, one token per call, attention over the masked static cache instead of the causal
# kernel), so fp32 sums run in other orders; each op may differ by a few ulps (~1e-7 relative) and depth and
# routing softmaxes compound that (observed <= 2e-6 here; sharper routing, query std 1 at H = 1, reaches
# 1.4e-5, which the fp64 case covers). In fp64 the same comparison holds to 1e-12 (observed ~1e-14) even with
# query std 1: the math is identical, only rounding differs. A wrong position, mask or cache entry is >= 1e-2.
PRECISIONS = {"fp32": (torch.float32, 0.3, 1e-5), "fp64-sharp": (torch.float64, 1.0, 1e-12)}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name,heads", CASES, ids=[f"{n}-H{h}" if h else n for n, h in CASES])
def test_cached_decoding_equals_full_forward(name, heads, precision):
    """Prefill of a left-padded batch + N single-token steps give each row's full-forward logits at every
    position of its own (unpadded) sequence."""
    dtype, query_std, tol = PRECISIONS[precision]
    model = randomised_model(name, heads, query_std=query_std, dtype=dtype)
    prompts, continuations = prompts_and_continuations()
    ids, mask = left_pad(prompts)
    width, steps = ids.shape[1], len(continuations[0])
    cache = KVCache.for_model(model, len(prompts), width + steps)
    with torch.no_grad():
        cache.next_valid = mask
        prefill_logits = model(ids, cache)
        step_logits = [model(torch.tensor([[c[j]] for c in continuations]), cache)[:, 0] for j in range(steps)]
        for row, (prompt, cont) in enumerate(zip(prompts, continuations)):
            reference = model(torch.tensor([prompt + cont]))[0]
            cached = torch.cat([prefill_logits[row, width - len(prompt):],
                                torch.stack([s[row] for s in step_logits])])
            assert reference.abs().max() > 0.1  # a meaningful scale for the absolute tolerance
            err = (cached - reference).abs().max().item()
            assert err <= tol, (name, heads, row, err)


@pytest.mark.parametrize("name,heads", [("standard", None), ("full", 8), ("delta", 8), ("hyper-dynamic", None)])
def test_unpadded_prefill_is_the_full_forward_bitwise(name, heads):
    """On an empty cache an unpadded prompt attends over its own tokens with the training forward's causal call,
    so a prefill's logits are the full forward's, bit for bit, whatever room the cache has for later tokens."""
    model = randomised_model(name, heads)
    ids = torch.randint(0, 320, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids)
        for room in (11, 40):
            assert torch.equal(model(ids, KVCache.for_model(model, 3, room)), expected), room


@pytest.mark.parametrize("name,heads", [("standard", None), ("full", 8), ("delta", 8)])
def test_a_prompt_fed_in_pieces_equals_the_full_forward(name, heads):
    """Only the first call on an empty cache attends over its own tokens: a second piece of the prompt (and every
    decode step) reads the cached columns before it."""
    model = randomised_model(name, heads)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(6))
    cache = KVCache.for_model(model, 2, 16)
    with torch.no_grad():
        pieces = torch.cat([model(ids[:, :5], cache), model(ids[:, 5:9], cache), model(ids[:, 9:], cache)], dim=1)
        err = (pieces - model(ids)).abs().max().item()
    assert err <= 1e-5, err  # fp32 tolerance of the cached test above


def test_routing_is_far_from_uniform_in_the_cached_test():
    """The randomised fp32 models above route non-uniformly (else a cache bug in routing inputs could hide)."""
    from mhar_lit.analysis import capture_sources
    from mhar_lit.routing import routing_weights

    model = randomised_model("full", 8)
    final = 2 * model.config.num_layers
    sources = capture_sources(model, torch.tensor([prompts_and_continuations()[0][0]]))[final]
    r = model.residual
    weights = routing_weights(sources, r.query[final], r.key_norm[final], r.heads, r.eps).mean((1, 2))  # [N, H]
    assert (weights.max(0).values > 2.0 / weights.shape[0]).any()


def reference_forward(model, ids):
    """The training forward written out with the plain causal attention: the no-cache path must equal it."""
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(ids.shape[1], x.device, x.dtype)
    residual = model.residual
    state = residual.begin(x)
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(residual.sublayer_input(state, 2 * layer.index))
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.num_heads != attn.num_kv_heads)
        state = residual.sublayer_output(state, 2 * layer.index, attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)))
        h = residual.sublayer_input(state, 2 * layer.index + 1)
        state = residual.sublayer_output(state, 2 * layer.index + 1, layer.mlp(layer.post_attention_layernorm(h)))
    return model.lm_head(model.norm(residual.final(state)))


@pytest.mark.parametrize("name", ["standard", "full", "delta", "hyper-dynamic"])
def test_training_forward_is_bitwise_unchanged_without_a_cache(name):
    model = randomised_model(name, 4).train()
    ids = torch.randint(0, 320, (2, 19), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    expected = reference_forward(model, ids)
    assert torch.equal(logits, expected)
    grads = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
    expected_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_decode_step_has_fixed_shapes_and_the_cache_refuses_overflow():
    model = randomised_model("full", 8)
    cache = KVCache.for_model(model, 2, 6)
    ids, mask = left_pad([[1, 2, 3], [4]])
    seen = []
    with torch.no_grad():
        cache.next_valid = mask
        model(ids, cache)
        for _ in range(3):
            model(torch.tensor([[5], [6]]), cache)
            seen.append((cache.keys.shape, cache.key_valid.shape))
        assert len(set(seen)) == 1 and int(cache.write_index) == 6
        assert cache.key_valid.tolist() == [[True] * 6, [False, False, True, True, True, True]]
        assert cache.next_position.tolist() == [6, 4]
        with pytest.raises(IndexError, match="out of"):
            model(torch.tensor([[5], [6]]), cache)


def _decode_twice(step, name, heads, device="cpu"):
    """Logits of eager decode_step and of `step(model, tokens, cache)` on identical caches, step by step."""
    from mhar_lit.generation import decode_step, prefill

    model = randomised_model(name, heads).to(device)
    prompts, continuations = prompts_and_continuations()
    ids, mask = left_pad(prompts, device=device)
    caches = [KVCache.for_model(model, len(prompts), ids.shape[1] + 6) for _ in range(2)]
    pairs = []
    with torch.no_grad():
        for cache in caches:
            prefill(model, ids, mask, cache)
        for j in range(6):
            tokens = torch.tensor([c[j] for c in continuations], device=device)
            pairs.append((decode_step(model, tokens, caches[0]), step(model, tokens, caches[1])))
    return pairs


@pytest.mark.parametrize("name,heads", [("full", 8), ("hyper-dynamic", None)])
def test_decode_step_compiles_to_one_graph_for_every_position(name, heads):
    """No graph break and no recompilation from one position to the next (fixed shapes, tensor bookkeeping)."""
    import torch._dynamo

    from mhar_lit.generation import decode_step

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        step = torch.compile(decode_step, fullgraph=True, dynamic=False, backend="eager")
        for eager, compiled in _decode_twice(step, name, heads):
            assert torch.equal(eager, compiled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_step_replays_as_a_cuda_graph():
    """One captured step replayed at every position gives the eager logits (the cache advances on the GPU)."""
    from mhar_lit.generation import decode_step
    from mhar_lit.generation.graph import CapturedStep

    graph = []

    def captured(model, tokens, cache):
        if not graph:
            graph.append(CapturedStep(decode_step, model, cache, tokens))
        return graph[0](tokens).clone()

    for eager, replayed in _decode_twice(captured, "full", 8, device="cuda"):
        assert torch.allclose(eager, replayed, rtol=0, atol=1e-5)


def test_triton_strategy_decodes_on_the_torch_path_and_keeps_its_backend():
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_name("tiny-4l"), FullAttnRes(heads=4)).eval()
    model.residual.set_routing_backend("triton", {"chunk": 2})
    with decode_routing(model):
        assert model.residual.backend == "torch"
    assert model.residual.routing_choice == ("triton", {"chunk": 2})
    generate(model, [[1, 2, 3]], 3)
    assert model.residual.routing_choice == ("triton", {"chunk": 2})


# ---------------------------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("strategy", ["standard", "delta"])
def test_converted_model_generates_transformers_greedy_tokens(family, strategy, tmp_path):
    """Greedy tokens of the converted model (standard, and delta at its identity init) == transformers'
    generate on the original, for a batch of prompts of different lengths (left-padded on our side)."""
    pytest.importorskip("transformers")
    from test_convert import SHAPE, hf_model

    from mhar_lit.convert import convert_hf, load_pretrained

    hf = hf_model(family)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens on both sides
    hf.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "ours", strategy=strategy, heads=4, num_blocks=2)
    ours = load_pretrained(tmp_path / "ours")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (9, 4, 13)]
    got = generate(ours, prompts, max_new_tokens=24)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------- sampling
def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(20000, 4)
    gen = torch.Generator().manual_seed(0)
    sharpened = (probs ** 2 / (probs ** 2).sum()).tolist()  # temperature 0.5 squares the probabilities
    cases = [(Sampling(0.5), {0, 1, 2, 3}, sharpened),
             (Sampling(1.0, top_k=2), {1, 3}, [0.0, 0.625, 0.0, 0.375]),
             (Sampling(1.0, top_p=0.75), {1, 3}, [0.0, 0.625, 0.0, 0.375]),
             (Sampling(1.0, top_p=0.9), {1, 2, 3}, [0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95]),
             (Sampling(1.0, top_p=0.4), {1}, [0.0, 1.0, 0.0, 0.0]),
             (Sampling(1.0), {0, 1, 2, 3}, probs.tolist())]
    for sampling, support, expected in cases:
        drawn = next_tokens(logits, sampling, gen)
        assert set(drawn.tolist()) == support, sampling
        freq = torch.bincount(drawn, minlength=4).float() / len(drawn)
        assert torch.allclose(freq, torch.tensor(expected), atol=0.015), (sampling, freq)
    # ties at the k-th value are kept
    kept = torch.isfinite(filter_logits(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), top_k=2))
    assert kept.tolist() == [[False, True, True, False]]
    assert next_tokens(torch.tensor([[0.0, 3.0, 1.0]]), Sampling()).tolist() == [1]


def test_bad_sampling_settings_are_refused():
    for kwargs, match in [(dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k"),
                          (dict(temperature=1, top_p=0), "top_p"), (dict(temperature=1, top_p=1.5), "top_p")]:
        with pytest.raises(ValueError, match=match):
            Sampling(**kwargs)


def test_sampling_with_a_seed_is_reproducible():
    model = randomised_model("delta", 8)
    prompts = [[5, 6, 7], [8]]
    sampling = Sampling(temperature=1.0, top_k=50, top_p=0.95)

    def run(seed):
        return generate(model, prompts, 12, sampling, torch.Generator().manual_seed(seed))

    first = run(0)
    assert run(0) == first
    assert run(1) != first
    assert all(len(t) == 12 for t in first)


def test_eos_and_stop_strings_finish_rows_independently():
    model = randomised_model("block", 8)
    prompts = [[10, 11, 12], [20], [30, 31]]
    free = generate(model, prompts, 10)
    eos = free[0][3]
    with_eos = generate(model, prompts, 10, eos_ids=[eos])
    for row, tokens in zip(free, with_eos):
        assert tokens == (row[: row.index(eos)] if eos in row else row)

    def decode(ids):
        return " ".join(map(str, ids))

    stop = f"{free[1][2]} {free[1][3]}"  # appears once row 1 has produced its 4th token
    stopped = generate(model, prompts, 10, stop=[stop], decode=decode)
    assert stopped[1] == free[1][: next(i for i in range(len(free[1])) if stop in decode(free[1][: i + 1])) + 1]
    for row in (0, 2):
        first = next((i for i in range(len(free[row])) if stop in decode(free[row][: i + 1])), None)
        assert stopped[row] == (free[row] if first is None else free[row][: first + 1])
    assert cut_at_stop(decode(stopped[1]), [stop]) == decode(stopped[1]).split(stop)[0]


def test_prompt_longer_than_the_context_is_refused_and_budget_capped():
    model = randomised_model("standard", None)
    context = model.config.max_position_embeddings
    with pytest.raises(PromptTooLongError, match=f"longer than the model's context of {context}"):
        generate(model, [[1] * (context + 1)], 4)
    assert [len(t) for t in generate(model, [[1] * (context - 3), [2]], 10)] == [3, 3]


# ---------------------------------------------------------------------------------------------- command line
def test_text_stream_prints_complete_characters_and_holds_back_stop_prefixes():
    from io import StringIO

    from mhar_lit.data.tokenizer import ByteTokenizer

    tok, out = ByteTokenizer(), StringIO()
    stream = TextStream(tok.decode, ["<END>"], out)
    data = list("héllo <EN".encode()) + list("D> tail".encode())
    for i in range(1, len(data) + 1):
        stream.update(data[:i], False)
        assert "\ufffd" not in out.getvalue() and "<" not in out.getvalue()
    stream.update(data, True)
    assert out.getvalue() == "héllo "


@pytest.fixture(scope="module")
def trained_ckpt(trained_demo_checkpoint):
    """A tiny FullAttnRes model trained for 4 steps by the real `fit` command (conftest: built once per run)."""
    return trained_demo_checkpoint


def test_generate_help_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "mhar_lit.generation", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": python_path()}, check=True).stdout
    for flag in ("--ckpt", "--prompt", "--prompt_file", "--max_new_tokens", "--temperature", "--top_k", "--top_p",
                 "--seed", "--stop", "--device", "--dtype"):
        assert flag in out


def test_generate_command_on_a_trained_checkpoint(trained_ckpt, tmp_path, capsys, monkeypatch):
    from mhar_lit.data.tokenizer import ByteTokenizer
    from mhar_lit.lit.module import model_from_checkpoint

    model, tok = model_from_checkpoint(str(trained_ckpt)), ByteTokenizer()
    prompt = "alpha beta "
    expected = tok.decode(generate(model, [list(prompt.encode())], 20, eos_ids=[tok.eos_id])[0])
    assert generate_main(["--ckpt", str(trained_ckpt), "--prompt", prompt, "--max_new_tokens", "20",
                          "--device", "cpu"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    (tmp_path / "p.txt").write_text(prompt)
    monkeypatch.setattr(sys, "stdin", open(tmp_path / "p.txt"))
    sampled = []
    for source in (["--prompt_file", str(tmp_path / "p.txt")], ["--prompt", "-"], ["--prompt", prompt]):
        assert generate_main(["--ckpt", str(trained_ckpt), *source, "--max_new_tokens", "20", "--device", "cpu",
                              "--temperature", "1.0", "--top_k", "40", "--seed", "7"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1] == sampled[2]
    stop = expected[3:5]
    assert generate_main(["--ckpt", str(trained_ckpt), "--prompt", prompt, "--max_new_tokens", "20",
                          "--stop", "zzz", "--stop", stop]) == 0
    assert capsys.readouterr().out == expected.split(stop)[0] + "\n"


def _one_line_error(capsys, argv, match):
    assert generate_main(argv) == 2  # the exit code of every user error, from every command
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and match in err, err


def test_generate_command_errors(trained_ckpt, tmp_path, capsys):
    from mhar_lit.checkpoint import record_checksum

    ckpt = str(trained_ckpt)
    _one_line_error(capsys, ["--ckpt", ckpt, "--prompt", "x" * 600], "longer than the model's context of 512")
    _one_line_error(capsys, ["--ckpt", ckpt, "--prompt", "x", "--tokenizer", str(tmp_path / "no.json")],
                    "no.json")
    _one_line_error(capsys, ["--ckpt", str(tmp_path / "missing.ckpt"), "--prompt", "x"], "missing.ckpt")
    _one_line_error(capsys, ["--ckpt", ckpt, "--prompt", "x", "--top_p", "2"], "top_p")
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    for name, settings, match in [("none.ckpt", None, "does not record its tokenizer"),
                                  ("gone.ckpt", {"tokenizer": str(tmp_path / "gone.json")}, "gone.json"),
                                  ("bpe.ckpt", {"tokenizer": "bpe:300", "cache_dir": str(tmp_path)}, "bpe-300-")]:
        if settings is None:
            checkpoint.pop("datamodule_hyper_parameters")
        else:
            checkpoint["datamodule_hyper_parameters"] = settings
        torch.save(checkpoint, tmp_path / name)
        record_checksum(tmp_path / name)  # as a checkpoint `fit` writes
        _one_line_error(capsys, ["--ckpt", str(tmp_path / name), "--prompt", "x"], match)
    assert generate_main(["--ckpt", str(tmp_path / "none.ckpt"), "--prompt", "x", "--tokenizer", "bytes",
                          "--max_new_tokens", "2"]) == 0


def test_generate_command_on_a_converted_directory(tmp_path, capsys):
    """A converted directory: load_pretrained plus its tokenizer.json; EOS from generation_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from mhar_lit.convert import save_pretrained

    torch.manual_seed(0)
    save_pretrained(randomised_model("delta", 4), tmp_path / "model")
    _one_line_error(capsys, ["--ckpt", str(tmp_path / "model"), "--prompt", "x"], "has no tokenizer.json")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cat sat on the mat"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert generate_main(["--ckpt", str(tmp_path / "model"), "--prompt", "the cat", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out.endswith("\n")



# `python -m mhar_lit generate ARGS` in a fresh interpreter; writes which heavy modules it imported to a file.
_GENERATE_AND_LIST_IMPORTS = """
import json, sys
from mhar_lit.cli import main
try:
    main(sys.argv[2:])
except SystemExit as done:
    assert not done.code, done.code
heavy = [name for name in ("lightning", "pytorch_lightning", "torch._dynamo") if name in sys.modules]
open(sys.argv[1], "w").write(json.dumps(heavy))
"""


@pytest.mark.parametrize("source", ["checkpoint", "directory"])
def test_generate_imports_neither_lightning_nor_dynamo(source, trained_ckpt, tmp_path):
    """Generation is PyTorch only: from a fit's .ckpt (whose model is rebuilt without mhar_lit.lit) or a saved
    directory (built on the meta device, then loaded), Lightning and torch._dynamo stay unimported (the latter
    costs about 2 s)."""
    from mhar_lit.convert import save_pretrained

    if source == "checkpoint":
        ckpt = str(trained_ckpt)
    else:
        ckpt = str(tmp_path / "model")
        save_pretrained(randomised_model("full", 4), ckpt)
    listed = tmp_path / "imported.json"
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run([sys.executable, "-c", _GENERATE_AND_LIST_IMPORTS, str(listed), "generate", "--ckpt", ckpt,
                           "--tokenizer", "bytes", "--prompt", "def ", "--max_new_tokens", "3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(listed.read_text()) == [], done.stderr[-3000:]

# ---------------------------------------------------------------------------------------------- SampleText
def test_sample_text_logs_continuations_to_mlflow(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    from mhar_lit.data.datamodule import TokenDataModule
    from mhar_lit.lit.module import LanguageModel
    from mhar_lit.lit.samples import SampleText

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ["alpha", "beta", "gamma", "delta"]
    for i in range(12):  # distinct documents: the validation split is chosen by content hash
        (corpus / f"doc{i}.txt").write_text(" ".join(words[(i * j) % 4] for j in range(240)) + f" {i}")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="samples", tracking_uri=uri)
    samples = SampleText(prompts=["alpha ", "gamma"], max_new_tokens=8, every_n_val=2, temperature=1.0)
    trainer = L.Trainer(max_steps=6, val_check_interval=2, limit_val_batches=1, logger=logger,
                        callbacks=[samples], enable_checkpointing=False, enable_progress_bar=False,
                        num_sanity_val_steps=1, accelerator="cpu", default_root_dir=tmp_path)
    data = TokenDataModule(str(corpus), seq_len=32, batch_size=2, num_workers=0, cache_dir=str(tmp_path / "cache"),
                           val_fraction=0.3)
    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=4), warmup_steps=1)
    trainer.fit(module, data)
    client = MlflowClient(uri)
    files = sorted(a.path for a in client.list_artifacts(logger.run_id, "samples"))
    assert files == ["samples/step_000004.txt"]  # validations at 2, 4, 6: every second one, sanity check skipped
    text = Path(client.download_artifacts(logger.run_id, "samples/step_000004.txt", str(tmp_path))).read_text()
    assert text.startswith("step 4\n") and text.count("=== ") == 4
    assert "('alpha ' (greedy))" not in text and "=== 'alpha ' (greedy) ===\nalpha " in text
    assert "(sampled seed 0, temperature 1, top_p 0.95)" in text
    assert module.model.training  # restored after generating


def test_sample_text_is_a_no_op_without_mlflow():
    from types import SimpleNamespace

    from mhar_lit.lit.samples import SampleText

    calls = []
    samples = SampleText(max_new_tokens=2)
    samples.samples = lambda *a: calls.append(a) or ""
    trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True, loggers=[], datamodule=None,
                              global_step=3)
    samples.on_validation_end(trainer, None)
    assert calls == []
