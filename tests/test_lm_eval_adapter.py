"""lm-eval adapter: loglikelihood, rolling and greedy generation equal direct computations with the model."""

import pytest
import torch
import torch.nn.functional as F

from mhar_lit.config import ModelConfig
from mhar_lit.convert import save_pretrained
from mhar_lit.eval.lm_eval_adapter import MHARScorer, TokenizerJSON, build_scorer
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import DeltaAttnRes

TEXTS = ["The cat sat on the mat.", "A dog ran in the park and the cat sat still.", "Two plus two is four.",
         "The quick brown fox jumps over the lazy dog."] * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random delta model (gates opened, so routing matters) saved with a tiny byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("lm") / "model"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_name("tiny-4l", vocab_size=300), DeltaAttnRes(heads=4, layers_per_block=2))
    with torch.no_grad():
        model.residual.gate.normal_()
    save_pretrained(model, path)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def scorer(model_dir):
    return build_scorer(str(model_dir), device="cpu", dtype="float32", batch_size=3)


def direct_logprob(model, context_ids, continuation_ids):
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = F.log_softmax(model(ids)[0, :-1].float(), -1)
    positions = range(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
    return sum(logprobs[p, t].item() for p, t in zip(positions, continuation_ids))


def test_loglikelihood_matches_direct_computation(scorer):
    """Sum of continuation log-probs == one forward of context+continuation; trailing space moves over."""
    tok, model = scorer.tokenizer, scorer.model
    requests = [("The cat", " sat on the mat."), ("Two plus two is ", "four."), ("", "The dog ran."),
                ("A dog ran in the park and", " the cat")]
    results = scorer.loglikelihood(requests)
    for (context, continuation), (score, _) in zip(requests, results):
        if not context:
            expected = direct_logprob(model, [tok.eos_id], tok.encode(continuation))
        else:
            stripped = context.rstrip()  # "Two plus two is " + "four." is scored as "Two plus two is" + " four."
            ctx, whole = tok.encode(stripped), tok.encode(context + continuation)
            assert whole[: len(ctx)] == ctx
            expected = direct_logprob(model, ctx, whole[len(ctx):])
        assert abs(score - expected) <= 1e-4, (context, score, expected)


def test_batching_does_not_change_scores(model_dir, scorer):
    one = build_scorer(str(model_dir), device="cpu", dtype="float32", batch_size=1)
    requests = [(t[:9], t[9:]) for t in TEXTS[:4]]
    for (a, ga), (b, gb) in zip(one.loglikelihood(requests), scorer.loglikelihood(requests)):
        assert abs(a - b) <= 1e-5 and ga == gb


def test_is_greedy_flag(scorer):
    ctx = scorer.tokenizer.encode("The cat sat")
    with torch.no_grad():
        best = int(scorer.model(torch.tensor([ctx]))[0, -1].argmax())
    other = (best + 1) % scorer.model.config.vocab_size
    (_, greedy), (_, not_greedy) = scorer.loglikelihood_tokens([(ctx, [best]), (ctx, [other])])
    assert greedy and not not_greedy


def test_rolling_windows_cover_every_token_once(scorer):
    small = MHARScorer(scorer.model, scorer.tokenizer, max_length=8, prefix_token_id=scorer.prefix_token_id)
    tokens = list(range(1, 21))
    windows = small.rolling_windows(tokens)
    assert [t for _, targets in windows for t in targets] == tokens
    assert all(len(ctx) + len(targets) - 1 <= 8 for ctx, targets in windows)
    assert windows[0][0] == [small.prefix_token_id]


def test_loglikelihood_rolling_matches_direct_computation(scorer):
    """With a long window: one forward over [prefix] + text; with short windows: the sum over the windows."""
    text = TEXTS[1] + " " + TEXTS[3]
    tokens = scorer.tokenizer.encode(text)
    (rolling,) = scorer.loglikelihood_rolling([text])
    assert abs(rolling - direct_logprob(scorer.model, [scorer.prefix_token_id], tokens)) <= 1e-4
    small = MHARScorer(scorer.model, scorer.tokenizer, max_length=8, prefix_token_id=scorer.prefix_token_id)
    expected = sum(direct_logprob(scorer.model, ctx, targets) for ctx, targets in small.rolling_windows(tokens))
    assert abs(small.loglikelihood_rolling([text])[0] - expected) <= 1e-4


def greedy_reference(model, ids, steps):
    ids = list(ids)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(token)
        out.append(token)
    return out


def test_generate_until_is_greedy_and_stops(scorer):
    tok = scorer.tokenizer
    prompts = ["The cat", "A dog ran in the park"]
    outs = scorer.generate_until([(p, {"until": [], "max_gen_toks": 6}) for p in prompts])
    for prompt, out in zip(prompts, outs):
        reference = greedy_reference(scorer.model, tok.encode(prompt), 6)
        if tok.eos_id in reference:
            reference = reference[: reference.index(tok.eos_id)]
        assert out == tok.decode(reference)
    first = outs[0]
    if len(first) > 2:  # stopping at a string cuts before its first occurrence
        stop = first[1:3]
        (cut,) = scorer.generate_until([("The cat", {"until": [stop], "max_gen_toks": 6})])
        assert cut == first.split(stop)[0]


def test_lm_eval_registration(model_dir):
    """When lm_eval is installed, `--model mhar_lit` resolves to the adapter and answers Instances."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import mhar_lit.eval.lm_eval_adapter  # noqa: F401  (registers the model)

    lm = get_model("mhar_lit").create_from_arg_string(f"path={model_dir},device=cpu,dtype=float32",
                                                      {"batch_size": 2})
    ll = [Instance("loglikelihood", {}, ("The cat", " sat"), 0)]
    roll = [Instance("loglikelihood_rolling", {}, ("The cat sat.",), 0)]
    gen = [Instance("generate_until", {}, ("The cat", {"until": ["."], "max_gen_toks": 4}), 0)]
    scorer = lm.scorer
    assert lm.loglikelihood(ll) == scorer.loglikelihood([("The cat", " sat")])
    assert lm.loglikelihood_rolling(roll) == scorer.loglikelihood_rolling(["The cat sat."])
    assert lm.generate_until(gen) == scorer.generate_until([("The cat", {"until": ["."], "max_gen_toks": 4})])


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TokenizerJSON(tmp_path / "nope.json")


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(model_dir, tmp_path, monkeypatch):
    """A tokenizer with ids past the model's vocab_size fails before the weights load (minutes at 8B), naming
    both numbers and the folder."""
    import shutil

    import mhar_lit.convert

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(mhar_lit.convert, "load_pretrained", no_load)

    path = tmp_path / "small-vocab"
    save_pretrained(DecoderLM(ModelConfig.from_name("tiny-4l", vocab_size=256)), path)
    shutil.copy(model_dir / "tokenizer.json", path / "tokenizer.json")
    ids = TokenizerJSON(path / "tokenizer.json").vocab_size
    assert ids > 256
    with pytest.raises(ValueError) as err:
        build_scorer(str(path), device="cpu", dtype="float32")
    assert str(err.value) == (f"tokenizer {path / 'tokenizer.json'} has {ids} token ids but the model in {path} has "
                              "vocab_size 256; pass the model's own tokenizer (tokenizer=PATH)")


def test_unreadable_tokenizer_json_names_the_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0"')
    with pytest.raises(ValueError, match=r"cannot read tokenizer .*tokenizer\.json"):
        TokenizerJSON(bad)


def test_generate_until_batches_prompts_of_different_lengths_greedily(model_dir, scorer):
    """A left-padded batch with the KV cache gives each prompt the uncached greedy continuation, in order."""
    tok = scorer.tokenizer
    prompts = ["The", "A dog ran in the park and the", "Two plus", "The quick brown fox"]
    outs = scorer.generate_until([(p, {"until": [], "max_gen_toks": 5}) for p in prompts])
    for prompt, out in zip(prompts, outs):
        reference = greedy_reference(scorer.model, tok.encode(prompt), 5)
        if tok.eos_id in reference:
            reference = reference[: reference.index(tok.eos_id)]
        assert out == tok.decode(reference)
    one = build_scorer(str(model_dir), device="cpu", dtype="float32", batch_size=1)
    assert one.generate_until([(p, {"until": [], "max_gen_toks": 5}) for p in prompts]) == outs


def test_generate_until_samples_with_the_scorer_seed(model_dir, scorer):
    """do_sample / temperature / top_k / top_p are honoured: equal seeds repeat, other seeds differ; do_sample
    False (or temperature 0) is greedy whatever the seed."""
    requests = [(p, {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0, "top_k": 50,
                     "top_p": 0.95}) for p in ("The cat", "A dog ran in the park")]
    other = build_scorer(str(model_dir), device="cpu", dtype="float32", batch_size=3, seed=99)
    first = scorer.generate_until(requests)
    assert scorer.generate_until(requests) == first
    assert other.generate_until(requests) != first
    greedy = [(p, {"until": [], "max_gen_toks": 8}) for p, _ in requests]
    expected = scorer.generate_until(greedy)
    for settings in ({"do_sample": False, "temperature": 1.0}, {"temperature": 0.0}):
        assert other.generate_until([(p, {**kw, **settings}) for p, kw in greedy]) == expected


def test_sampling_settings_follow_lm_eval_conventions(scorer):
    from mhar_lit.generation import Sampling

    rules = scorer._rules
    assert rules({"until": "\n\n"})[::2] == (("\n\n",), Sampling())
    assert rules({"temperature": 0.7})[2] == Sampling(0.7)  # a positive temperature alone samples
    assert rules({"do_sample": True})[2] == Sampling(1.0)
    assert rules({"do_sample": True, "temperature": 0.5, "top_k": 0, "top_p": 0.9})[2] == Sampling(0.5, None, 0.9)
    assert rules({"max_gen_toks": 7})[1] == 7
    with pytest.raises(ValueError, match="top_p"):
        rules({"do_sample": True, "top_p": 0.0})


def test_generate_until_keeps_request_order_across_settings(scorer):
    requests = [("The cat", {"until": [], "max_gen_toks": 3}), ("Two plus two", {"until": ["."], "max_gen_toks": 6}),
                ("A dog", {"until": [], "max_gen_toks": 3})]
    together = scorer.generate_until(requests)
    assert together == [scorer.generate_until([r])[0] for r in requests]


def test_a_trained_checkpoint_scores_like_its_model(tmp_path):
    """The adapter takes a Lightning .ckpt directly: its model with the run's tokenizer, scoring what the
    checkpoint's own model computes (byte tokens here)."""
    import lightning as L

    from mhar_lit.checkpoint import record_checksum
    from mhar_lit.lit.module import LanguageModel, model_from_checkpoint
    from mhar_lit.residual import FullAttnRes

    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=4, random_query_init=True), warmup_steps=1)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.randint(0, 256, (4, 17)), batch_size=2))
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    # outside the CLI the hyperparameters hold the strategy object itself (a pickle weights_only refuses); the CLI
    # stores its config instead: keep the checkpoint loadable the way a CLI-written one is
    saved = torch.load(ckpt, weights_only=False)
    saved["hyper_parameters"] = {}
    torch.save(saved, ckpt)
    record_checksum(ckpt)  # as AtomicCheckpointIO does for a checkpoint `fit` writes
    scorer = build_scorer(str(ckpt), tokenizer="bytes", device="cpu", dtype="float32")
    context, continuation = "def route(", "sources)"
    (logprob, _), = scorer.loglikelihood([(context, continuation)])
    model = model_from_checkpoint(str(ckpt)).eval()
    ids = torch.tensor([list((context + continuation).encode())])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1]).double(), -1)
    n = len(continuation.encode())
    expected = logp[0, -n:].gather(-1, ids[0, -n:, None]).sum().item()
    assert logprob == pytest.approx(expected, rel=1e-5)
