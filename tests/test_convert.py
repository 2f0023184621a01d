"""HF checkpoint conversion: exact identity of delta conversion, parity with transformers, clear errors."""

import errno
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mhar_lit.convert import (
    ConversionError,
    convert_hf,
    convert_main,
    export_hf,
    load_pretrained,
    load_weights_into,
    save_pretrained,
)
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import DeltaAttnRes, StandardResidual

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def hf_model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)
        cfg.rope_parameters = {**LLAMA3_ROPE, "rope_theta": 500000.0}
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a dropped or swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-sharded"])
def hf_dir(request, tmp_path_factory):
    family = request.param.split("-")[0]
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model = hf_model(family)
    model.save_pretrained(path, max_shard_size="40KB" if "sharded" in request.param else "5GB")
    return path, model


def ids(b=2, t=24, seed=0):
    return torch.randint(0, SHAPE["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def converted(hf_path, tmp_path, strategy, **kw):
    out = tmp_path / f"out-{strategy}"
    assert convert_main(["--from", str(hf_path), "--to", str(out), "--strategy", strategy, "--num-blocks", "2",
                         *kw.get("extra", [])]) == 0
    return out


def test_delta_equals_standard_exactly_and_matches_transformers(hf_dir, tmp_path):
    """Delta-converted logits == standard-converted logits bit for bit; both within 1e-5 of transformers."""
    hf_path, hf = hf_dir
    delta = load_pretrained(converted(hf_path, tmp_path, "delta"))
    standard = load_pretrained(converted(hf_path, tmp_path, "standard"))
    assert isinstance(delta.residual, DeltaAttnRes) and delta.residual.layers_per_block == 2
    assert isinstance(standard.residual, StandardResidual) and not delta.training
    x = ids()
    with torch.no_grad():
        a, b, ref = delta(x), standard(x), hf(x).logits
    assert (a - b).abs().max().item() == 0.0
    assert (a - ref).abs().max().item() <= 1e-5


def test_sharded_output_round_trips(hf_dir, tmp_path):
    """A conversion written as several shards + index loads back to the same logits."""
    hf_path, _ = hf_dir
    out = converted(hf_path, tmp_path, "delta", extra=["--max-shard-size", "30KB"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = load_pretrained(converted(hf_path, tmp_path, "standard"))
    with torch.no_grad():
        assert torch.equal(load_pretrained(out)(ids()), single(ids()))


def test_step0_gradients_and_first_step_moves_logits(hf_dir, tmp_path):
    """At init only the gates get gradient (q, key norm, null exactly 0); one AdamW step changes the logits."""
    hf_path, _ = hf_dir
    model = load_pretrained(converted(hf_path, tmp_path, "delta")).train()
    x = ids()
    before = model(x).detach()
    loss = torch.nn.functional.cross_entropy(before.new_tensor(0) + model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    res = model.residual
    assert res.gate.grad.abs().sum() > 0
    for p in (res.query, res.key_norm, res.null):
        assert p.grad is not None and p.grad.abs().max().item() == 0.0
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    with torch.no_grad():
        assert (model(x) - before).abs().max().item() > 0


def test_pretrained_tensors_are_copied_unchanged(hf_dir, tmp_path):
    """Every HF tensor appears in the converted file bit for bit, and the strategy keeps its identity init."""
    hf_path, hf = hf_dir
    out = converted(hf_path, tmp_path, "delta")
    model = load_pretrained(out)
    for name, value in hf.state_dict().items():
        ours = name.removeprefix("model.")
        assert torch.equal(model.state_dict()[ours], value), name
    assert model.residual.gate.abs().sum() == 0 and model.residual.query.abs().sum() == 0
    meta = json.loads((out / "mhar_config.json").read_text())
    assert meta["residual"]["init_args"]["layers_per_block"] == 2
    assert meta["source"]["architecture"] in ("LlamaForCausalLM", "Qwen3ForCausalLM")


def test_export_hf_round_trip(hf_dir, tmp_path):
    """standard -> export-hf loads in transformers with the original logits; non-standard strategies refused."""
    hf_path, hf = hf_dir
    out = converted(hf_path, tmp_path, "standard")
    back = tmp_path / "back"
    assert convert_main(["--export-hf", "--from", str(out), "--to", str(back)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert (reloaded(ids()).logits - hf(ids()).logits).abs().max().item() <= 1e-6
    with pytest.raises(ConversionError, match="StandardResidual"):
        export_hf(converted(hf_path, tmp_path, "delta"), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_standard_dir_into_delta_model_keeps_identity(hf_dir, tmp_path):
    """load_weights_into: a standard conversion into a delta model loads the transformer, keeps gates at 0."""
    hf_path, _ = hf_dir
    out = converted(hf_path, tmp_path, "standard")
    reference = load_pretrained(out)
    model = DecoderLM(reference.config, DeltaAttnRes(heads=8, layers_per_block=2))
    report = load_weights_into(model, out)
    assert report["kept_init"] and all(n.startswith("residual.") for n in report["kept_init"])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids()), reference(ids()))


def test_save_pretrained_round_trip(tmp_path):
    """save_pretrained(model) then load_pretrained gives the same weights and logits (tied, delta)."""
    from mhar_lit.config import ModelConfig

    torch.manual_seed(1)
    model = DecoderLM(ModelConfig.from_name("tiny-4l"), DeltaAttnRes(heads=4, layers_per_block=2)).eval()
    with torch.no_grad():
        model.residual.gate.normal_()
    save_pretrained(model, tmp_path / "saved")
    again = load_pretrained(tmp_path / "saved")
    assert again.lm_head.weight is again.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(again(ids()), model(ids()))



def test_a_directory_naming_foreign_code_is_refused(tmp_path):
    """mhar_config.json names the strategy's class; one outside mhar_lit.residual is never imported."""
    from mhar_lit.config import ModelConfig

    model = DecoderLM(ModelConfig.from_name("tiny"), DeltaAttnRes(heads=4, layers_per_block=1)).eval()
    save_pretrained(model, tmp_path / "saved")
    meta_path = tmp_path / "saved" / "mhar_config.json"
    meta = json.loads(meta_path.read_text())
    assert meta["residual"] == model.residual.to_config()
    meta["residual"] = {"class_path": "os.system", "init_args": {"command": "echo pwned"}}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConversionError, match="mhar_config.json: residual class_path 'os.system' is not in the "
                                              "allowed packages"):
        load_pretrained(tmp_path / "saved")


# ------------------------------------------------------------------------------------------ errors
def _copy_hf(hf_path: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in hf_path.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _no_output(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


@pytest.fixture
def single_hf(tmp_path):
    path = tmp_path / "hf"
    hf_model("qwen3").save_pretrained(path)
    return path


def _expect_error(tmp_path, src, match):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        convert_hf(src, out, strategy="delta", num_blocks=2)
    _no_output(tmp_path, out)
    assert convert_main(["--from", str(src), "--to", str(out), "--num-blocks", "2"]) == 2
    _no_output(tmp_path, out)


def test_truncated_safetensors_is_a_clear_error(tmp_path, single_hf):
    file = single_hf / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    _expect_error(tmp_path, single_hf, "model.safetensors: not a readable safetensors file")


def test_corrupt_safetensors_is_a_clear_error(tmp_path, single_hf):
    (single_hf / "model.safetensors").write_bytes(b"\x07garbage" * 20)
    _expect_error(tmp_path, single_hf, "model.safetensors: not a readable safetensors file")


def test_missing_tensor_is_named(tmp_path, single_hf):
    state = load_file(single_hf / "model.safetensors")
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, single_hf / "model.safetensors", metadata={"format": "pt"})
    _expect_error(tmp_path, single_hf, r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'")


def test_shape_mismatch_is_named(tmp_path, single_hf):
    state = load_file(single_hf / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(state, single_hf / "model.safetensors", metadata={"format": "pt"})
    _expect_error(tmp_path, single_hf, r"shape mismatch for tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'")


def test_unsupported_architecture_is_named(tmp_path, single_hf):
    cfg = json.loads((single_hf / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (single_hf / "config.json").write_text(json.dumps(cfg))
    _expect_error(tmp_path, single_hf, "unsupported field 'architectures'.*MistralForCausalLM")


def test_unsupported_feature_field_is_named(tmp_path, single_hf):
    cfg = json.loads((single_hf / "config.json").read_text())
    cfg["attention_bias"] = True
    (single_hf / "config.json").write_text(json.dumps(cfg))
    _expect_error(tmp_path, single_hf, "unsupported field 'attention_bias'")


def test_unreadable_config_is_a_clear_error(tmp_path, single_hf):
    (single_hf / "config.json").unlink()
    (single_hf / "config.json").mkdir()
    _expect_error(tmp_path, single_hf, re.escape(f"{single_hf / 'config.json'}: cannot read (Is a directory)"))


def test_blocks_must_divide_depth(tmp_path, single_hf):
    with pytest.raises(ConversionError, match="num_hidden_layers 4 is not divisible by --num-blocks 3"):
        convert_hf(single_hf, tmp_path / "out", num_blocks=3)
    _no_output(tmp_path, tmp_path / "out")


def test_heads_not_dividing_width_is_a_clear_cli_error(tmp_path, single_hf, capsys):
    out = tmp_path / "out"
    assert convert_main(["--from", str(single_hf), "--to", str(out), "--num-blocks", "2", "--heads", "3"]) == 2
    assert "not divisible by the number of routing heads 3" in capsys.readouterr().err
    _no_output(tmp_path, out)


def test_existing_output_needs_overwrite(tmp_path, single_hf):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="not empty; pass --overwrite"):
        convert_hf(single_hf, out, num_blocks=2)
    assert (out / "keep.txt").exists()
    convert_hf(single_hf, out, num_blocks=2, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "mhar_config.json").exists()


@pytest.mark.parametrize("export", [False, True], ids=["convert", "export-hf"])
@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_output_overlapping_the_source_is_refused(tmp_path, single_hf, capsys, export, where):
    """--to that resolves to --from, lies inside it or contains it is refused even with --overwrite: source intact."""
    src = convert_hf(single_hf, tmp_path / "std", strategy="standard") if export else single_hf
    dst = {"same": src / ".." / src.name, "inside": src / "out", "parent": tmp_path}[where]
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    flags = ["--export-hf"] if export else ["--num-blocks", "2"]
    assert convert_main([*flags, "--from", str(src), "--to", str(dst), "--overwrite"]) == 2
    relation = {"same": "is", "inside": "is inside", "parent": "contains"}[where]
    assert capsys.readouterr().err == (f"error: output directory {dst.resolve()} {relation} the source "
                                       f"directory {src.resolve()}; choose a --to outside the source\n")
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before


def _no_partial(tmp_path: Path) -> None:
    assert not [p for p in tmp_path.rglob("*") if ".partial-" in p.name or ".old-" in p.name]


def test_output_under_a_file_is_a_clear_error(tmp_path, single_hf, capsys):
    (tmp_path / "somefile").write_text("x")
    out = tmp_path / "somefile" / "out"
    assert convert_main(["--from", str(single_hf), "--to", str(out), "--num-blocks", "2"]) == 2
    assert capsys.readouterr().err == (f"error: cannot create output directory {out}: "
                                       f"{tmp_path / 'somefile'} is not a directory\n")
    assert (tmp_path / "somefile").read_text() == "x"
    _no_partial(tmp_path)


def test_unwritable_output_parent_is_a_clear_error(tmp_path, single_hf, capsys, monkeypatch):
    """A read-only file system (as root, chmod does not stop writes) fails naming --to, not the staging folder."""
    def read_only(prefix, dir):
        raise OSError(errno.EROFS, "Read-only file system", f"{dir}/{prefix}abcd")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    out = tmp_path / "new" / "deep" / "out"
    assert convert_main(["--from", str(single_hf), "--to", str(out), "--num-blocks", "2"]) == 2
    assert capsys.readouterr().err == f"error: cannot create output directory {out}: Read-only file system\n"
    assert not (tmp_path / "new").exists()  # the parents made for it are removed again


@pytest.mark.parametrize("failure", ["disk-full", "staging-vanished", "rename-fails"])
def test_write_failure_is_a_clear_error_and_keeps_the_old_output(tmp_path, single_hf, capsys, monkeypatch, failure):
    """An OS error while writing (with --overwrite) names --to, removes the staging folder, keeps the old output."""
    import shutil

    from mhar_lit.convert import io

    real_save, real_rename = io.save_file, io.os.rename

    def failing_rename(src, dst):  # moving the finished staging folder into place fails after the old one moved
        if ".partial-" in str(src):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))
        real_rename(src, dst)

    def failing_save(tensors, filename, metadata=None):
        if failure == "rename-fails":
            return real_save(tensors, filename, metadata=metadata)
        if failure == "staging-vanished":  # the real safetensors error (SafetensorError, not OSError)
            shutil.rmtree(Path(filename).parent)
            return real_save(tensors, filename, metadata=metadata)
        real_save(tensors, filename, metadata=metadata)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(io, "save_file", failing_save)
    if failure == "rename-fails":
        monkeypatch.setattr(io.os, "rename", failing_rename)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert convert_main(["--from", str(single_hf), "--to", str(out), "--num-blocks", "2", "--overwrite"]) == 2
    err = capsys.readouterr().err
    if failure == "disk-full":
        assert err == (f"error: cannot write output directory {out}: [Errno 28] No space left on device: "
                       f"'{out / 'model.safetensors'}'\n")
    elif failure == "rename-fails":
        assert err == f"error: cannot write output directory {out}: [Errno 18] Invalid cross-device link: " \
                      f"'{out}' -> '{out}'\n"
    else:
        assert err.startswith(f"error: cannot write output directory {out}: Error while serializing: ")
        assert ".partial-" not in err and str(out) in err.split(": ", 3)[-1]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    _no_partial(tmp_path)


def _write_tokenizer(path: Path, ids: int) -> None:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(ids)}, unk_token="w0"))
    assert tok.get_vocab_size(with_added_tokens=True) == ids
    tok.save(str(path))


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, single_hf):
    """A tokenizer.json whose ids exceed vocab_size (256) is not copied into a conversion or an export."""
    _write_tokenizer(single_hf / "tokenizer.json", 300)
    _expect_error(tmp_path, single_hf, re.escape(f"{single_hf / 'tokenizer.json'}: the tokenizer has 300 token ids "
                                                 "but the model's vocab_size is 256; ids >= 256 have no embedding"))
    _write_tokenizer(single_hf / "tokenizer.json", 256)
    std = convert_hf(single_hf, tmp_path / "std", strategy="standard")
    assert (std / "tokenizer.json").read_bytes() == (single_hf / "tokenizer.json").read_bytes()
    _write_tokenizer(std / "tokenizer.json", 257)
    with pytest.raises(ConversionError, match=re.escape(f"{std / 'tokenizer.json'}: the tokenizer has 257 token ids "
                                                        "but the model's vocab_size is 256")):
        export_hf(std, tmp_path / "back")
    _no_output(tmp_path, tmp_path / "back")


def test_load_weights_into_checks_config_and_shapes(tmp_path, single_hf):
    """init_from into a model of another shape fails naming the config field, then the tensor."""
    from mhar_lit.config import ModelConfig

    out = convert_hf(single_hf, tmp_path / "out", strategy="standard")
    cfg = load_pretrained(out).config
    wrong = DecoderLM(ModelConfig(**{**cfg.to_dict(), "intermediate_size": 96}))
    with pytest.raises(ConversionError, match="intermediate_size"):
        load_weights_into(wrong, out)
    with pytest.raises(ConversionError, match=r"shape mismatch for tensor 'layers\.0\.mlp\.(gate|up|down)_proj"):
        load_weights_into(wrong, out, check_config=False)
    with pytest.raises(ConversionError, match=r"unexpected tensor 'layers\.0\.self_attn\.[qk]_norm\.weight'"):
        load_weights_into(DecoderLM(ModelConfig(**{**cfg.to_dict(), "qk_norm": False})), out, check_config=False)


def test_languagemodel_init_from(tmp_path, single_hf):
    """LanguageModel(init_from=DIR) starts from the converted weights (what `fit --model.init_from` does)."""
    pytest.importorskip("lightning")
    from mhar_lit.lit.module import LanguageModel

    out = convert_hf(single_hf, tmp_path / "out", strategy="delta", num_blocks=2)
    cfg = load_pretrained(out).config.to_dict()
    overrides = {k: v for k, v in cfg.items() if k != "name"}
    lm = LanguageModel(size="tiny-4l", model_overrides=overrides, residual=DeltaAttnRes(heads=8, layers_per_block=2),
                       init_from=str(out))
    with torch.no_grad():
        assert torch.equal(lm.model.eval()(ids()), load_pretrained(out)(ids()))


def test_bf16_source_stays_bf16_and_loads_with_fp32_rope(tmp_path):
    """A bf16 checkpoint is copied as bf16 (bit for bit); load_pretrained(bf16) keeps RoPE frequencies fp32."""
    hf = hf_model("llama").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    out = convert_hf(tmp_path / "hf", tmp_path / "out", num_blocks=2)
    written = load_file(out / "model.safetensors")
    assert written["layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(written["layers.0.mlp.up_proj.weight"], hf.state_dict()["model.layers.0.mlp.up_proj.weight"])
    assert written["residual.gate"].dtype == torch.float32
    model = load_pretrained(out, dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.rotary.inv_freq.dtype == torch.float32
