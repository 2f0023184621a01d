"""Exported checkpoints: the same function through mhar_lit.load_pretrained, the lm-eval adapter and transformers
(trust_remote_code, in a process that cannot import mhar_lit), the byte tokenizer as a tokenizer.json, the import
walk that builds the remote code, the plain Llama / Qwen3 format and the CLI."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch

from mhar_lit import load_pretrained
from mhar_lit.convert.hf_config import ConversionError
from mhar_lit.data.tokenizer import ByteTokenizer, HFTokenizer
from mhar_lit.export import export_checkpoint, export_main
from mhar_lit.export import remote_code
from mhar_lit.checkpoint import record_checksum
from mhar_lit.lit.module import LanguageModel, model_from_checkpoint
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, HyperConnections, StandardResidual

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "standard": (StandardResidual, {}, {}),
    "hyper": (HyperConnections, {"streams": 4, "dynamic": True}, {"tie_embeddings": False}),
    "full": (FullAttnRes, {"heads": 4}, {}),
    "block": (BlockAttnRes, {"heads": 4, "layers_per_block": 2}, {}),
    "delta": (DeltaAttnRes, {"heads": 4, "layers_per_block": 2}, {}),
}
PROMPT, NEW_TOKENS = 5, 6
MIXED_TEXT = "plain ASCII, é ü ß, 世界, 🙂 emoji, tabs\tand\r\nnewlines, <|endoftext|> as text, NUL\x00 end"


def _lightning_checkpoint(path: Path, name: str) -> Path:
    """A LanguageModel checkpoint saved by a real Trainer, with every strategy parameter moved off its init
    (random routing queries, non-zero delta gates, dynamic hyper-connection terms), so routing is non-uniform."""
    cls, init_args, overrides = STRATEGIES[name]
    torch.manual_seed(sorted(STRATEGIES).index(name))
    module = LanguageModel(size="tiny-4l", residual=cls(**init_args), model_overrides=overrides)
    with torch.no_grad():
        for p in module.model.residual.parameters():
            p.add_(0.5 * torch.randn_like(p))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    record_checksum(path)  # as AtomicCheckpointIO does for every checkpoint `fit` writes
    return path


def _greedy(model, prompt: torch.Tensor, steps: int, eos: int) -> list[int]:
    """Greedy decoding by repeated full forwards of our own model (batch of one)."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(ids)[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token == eos:
                break
    return ids[0].tolist()


# The transformers side: run with `python -I` (no PYTHONPATH, no current directory) and an import hook that
# refuses mhar_lit, so an export that still needed mhar_lit fails here.
HF_SIDE = textwrap.dedent('''
    import json, sys

    class RefuseMharLit:
        def find_spec(self, name, path=None, target=None):
            if name == "mhar_lit" or name.startswith("mhar_lit."):
                raise ImportError(f"{name} is not importable in this process")
            return None

    sys.meta_path.insert(0, RefuseMharLit())
    try:
        import mhar_lit  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("mhar_lit is importable: the test would not show anything")
    import torch
    from transformers import AutoModelForCausalLM

    for job in json.load(open(sys.argv[1])):
        remote = job["kind"] == "remote"
        model = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=remote).eval()
        ids = torch.load(job["ids"])
        with torch.no_grad():
            logits = model(ids).logits
        generated = model.generate(ids[:1, : job["prompt"]], max_new_tokens=job["new_tokens"], do_sample=False)
        torch.save({"class": type(model).__name__, "logits": logits, "generated": generated[0].tolist(),
                    "modules": sorted(m for m in sys.modules if m.startswith("mhar_lit"))}, job["out"])
''')


def _run_transformers(tmp: Path, jobs: list[dict]) -> None:
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "hf_side.py").write_text(HF_SIDE)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp / "hf_modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-I", str(tmp / "hf_side.py"), str(tmp / "jobs.json")], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every strategy: checkpoint, export, our logits and greedy tokens; plus the standard model as --format hf."""
    tmp = tmp_path_factory.mktemp("export")
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    cases = {}
    for name in STRATEGIES:
        ckpt = _lightning_checkpoint(tmp / f"{name}.ckpt", name)
        out = export_checkpoint(ckpt, tmp / name, tokenizer="bytes", trust_pickle=True)
        model = model_from_checkpoint(str(ckpt), trust_pickle=True)
        with torch.no_grad():
            logits = model(ids)
        cases[name] = {"ckpt": ckpt, "dir": out, "model": model, "logits": logits,
                       "greedy": _greedy(model, ids[:1, :PROMPT], NEW_TOKENS, ByteTokenizer.eos_id)}
    plain = export_checkpoint(cases["standard"]["ckpt"], tmp / "standard-hf", format="hf", tokenizer="bytes",
                              trust_pickle=True)
    cases["plain"] = {"dir": plain, "logits": cases["standard"]["logits"], "greedy": cases["standard"]["greedy"]}
    return {"tmp": tmp, "ids": ids, "cases": cases}


@pytest.fixture(scope="module")
def transformers_results(exported):
    """What transformers computes from each export, in one process that cannot import mhar_lit."""
    tmp = exported["tmp"]
    torch.save(exported["ids"], tmp / "ids.pt")
    names = [*STRATEGIES, "plain"]
    jobs = [{"kind": "plain" if name == "plain" else "remote", "dir": str(exported["cases"][name]["dir"]),
             "ids": str(tmp / "ids.pt"), "out": str(tmp / f"{name}.hf.pt"), "prompt": PROMPT,
             "new_tokens": NEW_TOKENS} for name in names]
    _run_transformers(tmp, jobs)
    return {name: torch.load(job["out"]) for name, job in zip(names, jobs)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_load_pretrained_and_adapter_reproduce_the_checkpoint(exported, name):
    """The exported directory gives the checkpoint's model bit for bit through load_pretrained and through the
    lm-eval adapter's loading path (which also reads the exported tokenizer.json and finds EOS = 256)."""
    from mhar_lit.eval.lm_eval_adapter import build_scorer

    case, ids = exported["cases"][name], exported["ids"]
    loaded = load_pretrained(case["dir"])
    assert type(loaded.residual) is type(case["model"].residual)
    with torch.no_grad():
        assert torch.equal(loaded(ids), case["logits"])
    scorer = build_scorer(str(case["dir"]), device="cpu", dtype="float32")
    assert scorer.tokenizer.eos_id == ByteTokenizer.eos_id
    with torch.no_grad():
        assert torch.equal(scorer.model(ids), case["logits"])


@pytest.mark.parametrize("name", [*STRATEGIES, "plain"])
def test_transformers_without_mhar_lit_reproduces_logits_and_greedy_tokens(exported, transformers_results, name):
    """AutoModelForCausalLM (remote code; `plain`: Qwen3ForCausalLM of --format hf) in a process that cannot import
    mhar_lit: logits within 1e-5 relative of our forward, generate() = our greedy decode by full forwards."""
    case, hf = exported["cases"][name], transformers_results[name]
    assert hf["class"] == ("Qwen3ForCausalLM" if name == "plain" else "MharForCausalLM")
    assert hf["modules"] == []
    ours = case["logits"]
    torch.testing.assert_close(hf["logits"], ours, rtol=1e-5, atol=1e-5 * float(ours.abs().max()))
    assert hf["generated"] == case["greedy"]
    assert len(case["greedy"]) > PROMPT


@pytest.mark.parametrize("name", ["full", "delta"])
def test_probe_report_of_the_export_equals_the_checkpoints(exported, name):
    """The probe's analysis (probe_model) reads the loaded export exactly as the checkpoint's model."""
    from mhar_lit.analysis.probe import probe_model

    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(2))
    case = exported["cases"][name]
    reports = [probe_model(model, ids, null_draws=2, batch_size=2)[0]
               for model in (case["model"], load_pretrained(case["dir"]))]
    assert json.dumps(reports[0], sort_keys=True) == json.dumps(reports[1], sort_keys=True)


def test_the_template_also_works_inside_the_package(exported):
    """hf_modeling.py, the source of modeling_mhar.py, loads an export as is when mhar_lit is installed."""
    from mhar_lit.export.hf_modeling import MharForCausalLM

    case = exported["cases"]["block"]
    model = MharForCausalLM.from_pretrained(case["dir"]).eval()
    with torch.no_grad():
        assert torch.equal(model(exported["ids"]).logits, case["logits"])
    with pytest.raises(ValueError, match="no padding support"):
        model(exported["ids"], attention_mask=torch.tensor([[1] * 16, [0] + [1] * 15]))


def test_routing_is_not_uniform_in_the_exported_models(exported):
    """The checks above would not see a wrong routing weight if every weight were equal: they are not."""
    from mhar_lit.analysis import capture_sources
    from mhar_lit.routing import routing_weights

    model = exported["cases"]["full"]["model"]
    r = model.residual
    weights = [routing_weights(sources, r.query[site], r.key_norm[site], r.heads, r.eps).mean((1, 2))
               for site, sources in capture_sources(model, exported["ids"]).items()]
    spread = max(float(w.max() - w.min()) for w in weights if w.shape[0] > 1)
    assert spread > 0.05


def test_exported_files(exported):
    """Remote code for the strategy's module only (no kernels, no Lightning); config and generation config."""
    files = sorted(p.name for p in exported["cases"]["delta"]["dir"].iterdir())
    assert {"model.safetensors", "mhar_config.json", "config.json", "generation_config.json", "tokenizer.json",
            "modeling_mhar.py", "mhar_models_decoder.py", "mhar_residual_delta.py", "mhar_config.py"} <= set(files)
    assert not [f for f in files if "kernels" in f or "lit_" in f or f.startswith(".")]
    config = json.loads((exported["cases"]["delta"]["dir"] / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mhar.MharForCausalLM"
    assert config["residual_module"] == "mhar_residual_delta" and config["eos_token_id"] == 256
    for path in exported["cases"]["delta"]["dir"].glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [getattr(node, "module", None)]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                assert not any((n or "").startswith("mhar_lit") for n in names), (path.name, node.lineno)


def test_auto_tokenizer_loads_the_export_with_its_eos_and_no_remote_code(exported):
    """tokenizer_config.json names the fast tokenizer and the EOS: AutoTokenizer needs neither config.json's remote
    code nor trust_remote_code, and its eos_token is the model's EOS."""
    from transformers import AutoTokenizer

    folder = exported["cases"]["delta"]["dir"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 256
    assert tokenizer("héllo")["input_ids"] == list("héllo".encode())


# ---------------------------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_json_encodes_and_decodes_like_the_byte_tokenizer(exported):
    from tokenizers import Tokenizer

    from mhar_lit.eval.lm_eval_adapter import TokenizerJSON

    path = exported["cases"]["full"]["dir"] / "tokenizer.json"
    byte, library = ByteTokenizer(), Tokenizer.from_file(str(path))
    ours, adapter = HFTokenizer(path), TokenizerJSON(path)
    assert (ours.vocab_size, ours.eos_id, adapter.eos_id) == (257, 256, 256)
    expected = byte.encode_batch([MIXED_TEXT])[0].tolist()
    assert library.encode(MIXED_TEXT, add_special_tokens=False).ids == expected  # '<|endoftext|>' stays bytes
    assert ours.encode_batch([MIXED_TEXT])[0].tolist() == expected and adapter.encode(MIXED_TEXT) == expected
    with_eos = expected + [256] + expected[:7] + [256]
    assert byte.decode(with_eos) == MIXED_TEXT + MIXED_TEXT[:7]
    for decoded in (ours.decode(with_eos), adapter.decode(with_eos), library.decode(with_eos)):
        assert decoded == byte.decode(with_eos)
    broken = [0xE4, 0xB8, 0x41, 0xFF, 0xF0, 0x9F, 0x99, 256, 0x80]  # cut and invalid UTF-8, EOS inside a character
    assert ours.decode(broken) == byte.decode(broken) == bytes(broken[:7] + broken[8:]).decode(errors="replace")


def test_the_run_tokenizer_json_is_copied(tmp_path, exported):
    """A run on a tokenizer.json exports that file; its size is checked against the model's vocabulary."""
    ckpt = exported["cases"]["standard"]["ckpt"]
    source = exported["cases"]["standard"]["dir"] / "tokenizer.json"
    out = export_checkpoint(ckpt, tmp_path / "out", tokenizer=str(source), trust_pickle=True)
    assert (out / "tokenizer.json").read_bytes() == source.read_bytes()
    big = tmp_path / "big.json"
    vocab = json.loads(source.read_text())
    vocab["model"]["vocab"].update({f"<extra{i}>": 257 + i for i in range(100)})
    big.write_text(json.dumps(vocab))
    with pytest.raises(ConversionError, match="357 token ids but the model's vocab_size is 320"):
        export_checkpoint(ckpt, tmp_path / "big", tokenizer=str(big), trust_pickle=True)
    assert not (tmp_path / "big").exists()


# ---------------------------------------------------------------------------------------------- import walk
def test_import_walk_flattens_packages_and_re_exports(tmp_path, monkeypatch):
    """A package with __init__ re-exports, relative imports, submodule imports and a lazy optional import:
    the flat modules import as one package and compute the same thing."""
    root = tmp_path / "src" / "mhar_lit"
    files = {
        "__init__.py": "",
        "routing/__init__.py": "from .reference import route\nfrom . import math as math_module\n",
        "routing/math.py": "def double(x):\n    return 2 * x\n",
        "routing/reference.py": ("from mhar_lit.routing.math import double\n\n\ndef route(x, backend='torch'):\n"
                                 "    if backend == 'fast':\n        from mhar_lit.kernels.fast import fast_route\n\n"
                                 "        return fast_route(x)\n    return double(x) + 1\n"),
        "kernels/__init__.py": "",
        "kernels/fast.py": "import triton\n",
        "residual/__init__.py": "",
        "residual/thing.py": ("from mhar_lit.routing import math_module, route\nimport mhar_lit.routing.math as m\n\n\n"
                              "def apply(x):\n    return route(x) + math_module.double(x) + m.double(1)\n"),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(remote_code, "PACKAGE_DIR", root)
    modules = remote_code.required_modules(["mhar_lit.residual.thing"])
    assert modules == ["mhar_lit.residual.thing", "mhar_lit.routing", "mhar_lit.routing.math",
                       "mhar_lit.routing.reference"]
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "__init__.py").write_text("")
    for module in modules:
        text = remote_code.flatten_source(module, set(modules))
        (flat / f"{remote_code.flat_module_name(module)}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    thing = importlib.import_module("flat.mhar_residual_thing")
    assert thing.apply(3) == (2 * 3 + 1) + 6 + 2
    reference = importlib.import_module("flat.mhar_routing_reference")
    with pytest.raises(ImportError, match="mhar_lit.kernels.fast is not part of this exported model"):
        reference.route(1, backend="fast")
    (root / "residual" / "bad.py").write_text("import mhar_lit.routing\n")
    with pytest.raises(remote_code.RemoteCodeError, match="bad.py:1: `import mhar_lit.routing` without `as`"):
        remote_code.required_modules(["mhar_lit.residual.bad"])


# ---------------------------------------------------------------------------------------------- CLI and errors
def test_cli_exports_a_real_fit_checkpoint(tmp_path, monkeypatch, capsys):
    """`fit` of configs/demo.yaml for 2 steps (MHAR H = 4, random queries), then the export CLI: the tokenizer comes
    from the checkpoint's datamodule settings, the weights load back exactly; refusals are one-line errors."""
    from mhar_lit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):  # distinct documents: the validation split is chosen by content hash
        (corpus / f"doc{i}.txt").write_text(" ".join([f"routing depth heads ünïcode 世界 {i}"] * 200))
    cli = build_cli(["--config", str(REPO / "configs/demo.yaml"), "--model.size", "tiny",
                     "--model.residual.init_args.random_query_init", "true", "--trainer.max_steps", "2",
                     "--trainer.val_check_interval", "2",
                     "--data.data", str(corpus), "--data.seq_len", "32", "--data.batch_size", "2",
                     "--data.val_fraction", "0.2", "--data.cache_dir", str(tmp_path / "cache"),
                     "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
                     "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    ckpt = cli.trainer.checkpoint_callback.last_model_path
    out = tmp_path / "exported"
    assert export_main(["--ckpt", ckpt, "--to", str(out)]) == 0
    assert f"export: wrote {out}" in capsys.readouterr().out
    ids = torch.randint(0, 257, (1, 20))
    with torch.no_grad():
        assert torch.equal(load_pretrained(out)(ids), model_from_checkpoint(ckpt)(ids))
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"] == 256

    assert export_main(["--ckpt", ckpt, "--to", str(out)]) == 2  # the exit code of every user error
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert export_main(["--ckpt", ckpt, "--to", str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert load_pretrained(out, dtype="bfloat16").embed_tokens.weight.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    capsys.readouterr()
    assert export_main(["--ckpt", ckpt, "--to", str(tmp_path / "hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "--format hf needs a standard-residual model" in err and "FullAttnRes" in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()
    assert export_main(["--ckpt", ckpt, "--to", str(Path(ckpt).parent), "--overwrite"]) == 2
    assert "contains the checkpoint" in capsys.readouterr().err and Path(ckpt).is_file()
    assert export_main(["--ckpt", str(tmp_path / "missing.ckpt"), "--to", str(tmp_path / "x")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_a_bf16_checkpoint_is_exported_in_bf16(tmp_path):
    """bf16-true training stores bf16 weights: the default export keeps them bf16 (and exact)."""
    from safetensors import safe_open

    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=4), model_overrides={"tie_embeddings": False})
    module.to(torch.bfloat16)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "bf16.ckpt")
    record_checksum(tmp_path / "bf16.ckpt")
    out = export_checkpoint(tmp_path / "bf16.ckpt", tmp_path / "out", tokenizer="bytes", trust_pickle=True)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}
        assert torch.equal(weights.get_tensor("residual.key_norm"), module.model.residual.key_norm)
        assert torch.equal(weights.get_tensor("lm_head.weight"), module.model.lm_head.weight)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_checkpoint_without_tokenizer_settings_needs_one(tmp_path, exported):
    with pytest.raises(ConversionError, match="does not record its tokenizer"):
        export_checkpoint(exported["cases"]["full"]["ckpt"], tmp_path / "out", trust_pickle=True)
    with pytest.raises(ConversionError, match="pickled Python objects"):
        export_checkpoint(exported["cases"]["full"]["ckpt"], tmp_path / "out", tokenizer="bytes")
    assert not (tmp_path / "out").exists()


def test_module_entry_point_help():
    done = subprocess.run([sys.executable, "-m", "mhar_lit.export", "--help"], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0 and "--trust_checkpoint" in done.stdout and "--format" in done.stdout
