"""What a user meets: every command refuses bad input in one line with exit code 2 (a close match for an unknown
key), every reader refuses a checkpoint whose sha256 sidecar does not match (or that has none, unless told),
and a URI's password never reaches the terminal."""

import json
import logging

import pytest
import torch
from tiny_run import REPO, tiny_corpus, tiny_fit_args

from mhar_lit.checkpoint import record_checksum
from mhar_lit.cli import main


def _main_error(argv, capsys) -> str:
    """`python -m mhar_lit ARGV` in this process: exit code 2 and one line on stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err, err
    return lines[-1]


# ----------------------------------------------------------------------------- fit's settings
def test_a_typo_in_a_key_is_one_line_with_the_close_match(capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    err = _main_error(["fit", "--config", str(REPO / "configs/demo.yaml"), "--model.warmup_stesp", "3"], capsys)
    assert "--model.warmup_stesp" in err and "did you mean --model.warmup_steps?" in err
    err = _main_error(["fit", "--config", "no/such.yaml"], capsys)
    assert "no/such.yaml" in err and "does not exist" in err


def test_a_value_a_constructor_refuses_names_its_setting(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    err = _main_error(["fit", "--config", str(REPO / "configs/demo.yaml"), "--model.residual.init_args.heads", "3",
                       "--trainer.logger", "false"], capsys)
    assert err.startswith("error: model.residual: hidden size 128 is not divisible")


def test_an_empty_corpus_and_a_bad_val_fraction_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    base = ["fit", "--config", str(REPO / "configs/demo.yaml"), "--trainer.logger", "false", "--trainer.max_steps", "2"]
    empty = _main_error([*base, "--data.data", "empty.txt"], capsys)
    assert "the inputs contain no documents" in empty
    whole = _main_error([*base, "--data.data", str(tiny_corpus(tmp_path)), "--data.val_fraction", "1.0"], capsys)
    assert "data.val_fraction must be in [0, 1), got 1.0" in whole and "perplexity" in whole


def test_what_the_data_preparation_found_is_warned_once_per_fit(tmp_path, caplog):
    """A fit calls prepare_data (build or reuse) and then setup (lookup): no validation document and a skipped
    non-UTF-8 file are each one warning, on the first fit (build) and on the next (reuse)."""
    from mhar_lit.data.datamodule import TokenDataModule

    corpus = tiny_corpus(tmp_path)
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for fit in ("build", "reuse"):
        caplog.clear()
        data = TokenDataModule(data=str(corpus), seq_len=32, batch_size=4, num_workers=0, val_fraction=1e-9,
                               cache_dir=str(tmp_path / "cache"))
        with caplog.at_level(logging.WARNING, logger="mhar_lit.data"):
            data.prepare_data()
            data.setup("fit")
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum("no document fell in the validation split" in m for m in warned) == 1, (fit, warned)
        assert sum("skipped as not UTF-8" in m for m in warned) == 1, (fit, warned)
        assert data.val_dataset is None

@pytest.mark.parametrize("command", ["generate", "export", "probe", "perplexity", "sweep", "compare", "convert"])
def test_every_tool_refuses_an_unknown_flag_in_one_line_with_exit_code_2(command, capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    err = _main_error([command, "--no_such_flag", "1"], capsys)
    assert "unrecognized arguments: --no_such_flag 1" in err, err


@pytest.mark.parametrize("argv,typo,meant", [
    (["generate", "--ckptt", "x.ckpt"], "--ckptt", "--ckpt"),
    (["generate", "--ckpt", "x.ckpt", "--prompt_filee", "p.txt"], "--prompt_filee", "--prompt_file"),
    (["export", "--too", "dir"], "--too", "--to"),
    (["perplexity", "--ckptt", "x.ckpt", "--data", "d.txt"], "--ckptt", "--ckpt"),
    (["convert", "--fromm", "a", "--to", "b"], "--fromm", "--from"),
])
def test_a_typo_in_a_required_flag_is_named_before_what_is_missing(argv, typo, meant, capsys, monkeypatch):
    """The typo, not the required flag or prompt source it leaves out, is the one line (with its close match)."""
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    err = _main_error(argv, capsys)
    assert f"unrecognized arguments: {typo}" in err and f"did you mean {meant}" in err and "required" not in err, err


def test_generate_still_requires_exactly_one_prompt_source(capsys, monkeypatch):
    """Checked after the unknown flags: none given, or two given, is still one line; --help shows the choice."""
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    err = _main_error(["generate", "--ckpt", "x.ckpt"], capsys)
    assert err == ("error: one of the arguments --prompt --prompt_file/--prompt-file --prompts_jsonl/--prompts-jsonl "
                   "is required"), err
    err = _main_error(["generate", "--ckpt", "x.ckpt", "--prompt", "a", "--prompt_file", "b"], capsys)
    assert "--prompt_file/--prompt-file: not allowed with argument --prompt" in err, err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    assert "(--prompt PROMPT | --prompt_file PROMPT_FILE | --prompts_jsonl PROMPTS_JSONL)" in capsys.readouterr().out


def test_fit_arguments_before_the_sweeps_double_dash_get_the_hint(capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    err = _main_error(["sweep", "--config", "c.yaml", "--trainer.max_steps", "30"], capsys)
    assert "--trainer.max_steps" in err and "go after `--`" in err


# ----------------------------------------------------------------------------- checkpoints
def _checkpoint(path, seq_len=24):
    """A checkpoint in the layout `fit` writes, with its datamodule settings and sha256 sidecar."""
    from mhar_lit.lit.module import LanguageModel
    from mhar_lit.residual import FullAttnRes

    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=4, random_query_init=True))
    module.on_save_checkpoint(saved := {"state_dict": module.state_dict()})
    saved["datamodule_hyper_parameters"] = {"tokenizer": "bytes", "seq_len": seq_len, "val_fraction": 0.5}
    torch.save(saved, path)
    record_checksum(path)
    return path


def _flip_16_bytes(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


READERS = {
    "generate": ["generate", "--prompt", "x", "--max_new_tokens", "2"],
    "export": ["export", "--to", "{tmp}/out"],
    "probe": ["probe", "--out", "{tmp}/probe", "--tokens", "200", "--no_figures"],
}  # perplexity reads through generate's loader inside mhar_lit.eval.perplexity


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_a_checkpoint_that_does_not_match_its_sidecar(reader, tmp_path, capsys, monkeypatch):
    """16 flipped bytes, the sidecar beside them: refused in one line (generate printed noise and exited 0)."""
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    (tmp_path / "text.txt").write_text("alpha beta gamma " * 20)
    ckpt = _checkpoint(tmp_path / "m.ckpt")
    _flip_16_bytes(ckpt)
    argv = [word.format(tmp=tmp_path) for word in READERS[reader]] + ["--ckpt", str(ckpt)]
    err = _main_error(argv, capsys)
    assert f"checkpoint {ckpt} does not match the sha256 recorded" in err
    err = _main_error(argv + ["--allow_unverified"], capsys)  # never for a mismatch
    assert "does not match the sha256" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_checkpoint_without_a_sidecar_is_read_only_when_allowed(reader, tmp_path, capsys, monkeypatch):
    from mhar_lit.checkpoint import sidecar_path

    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("alpha beta gamma " * 20)
    ckpt = _checkpoint(tmp_path / "m.ckpt")
    sidecar_path(ckpt).unlink()
    argv = [word.format(tmp=tmp_path) for word in READERS[reader]] + ["--ckpt", str(ckpt)]
    err = _main_error(argv, capsys)
    assert "has no checksum file m.ckpt.sha256" in err and f"sha256sum {ckpt}" in err
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--allow_unverified"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err


def test_the_lm_eval_adapter_verifies_the_checkpoint(tmp_path):
    from mhar_lit.checkpoint import CorruptCheckpointError
    from mhar_lit.eval.lm_eval_adapter import build_scorer

    ckpt = _checkpoint(tmp_path / "m.ckpt")
    assert build_scorer(str(ckpt), device="cpu").tokenizer.eos_id == 256
    _flip_16_bytes(ckpt)
    with pytest.raises(CorruptCheckpointError, match="does not match the sha256"):
        build_scorer(str(ckpt), device="cpu")


def test_a_truncated_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    ckpt = _checkpoint(tmp_path / "m.ckpt")
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(ckpt.read_bytes()[:5000])
    record_checksum(cut)  # even a file whose sidecar matches: it is not a whole torch checkpoint
    err = _main_error(["generate", "--ckpt", str(cut), "--prompt", "x"], capsys)
    assert f"cannot read checkpoint {cut}: not a complete torch checkpoint" in err


def test_probe_defaults_to_the_training_sequence_length_and_says_what_it_found(tmp_path, capsys):
    from mhar_lit.analysis.probe import probe_main

    ckpt = _checkpoint(tmp_path / "m.ckpt", seq_len=24)
    assert probe_main(["--ckpt", str(ckpt), "--out", str(tmp_path / "p"), "--tokens", "480", "--no_figures"]) == 0
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    assert report["seq_len"] == 24
    printed = capsys.readouterr().out
    assert "from their consensus beyond the null" in printed and "split-half r" in printed


# ----------------------------------------------------------------------------- generate
def test_stop_escapes_are_decoded_as_documented():
    from mhar_lit.errors import UserError
    from mhar_lit.generation.cli import decode_escapes

    assert decode_escapes(r"\n\n") == "\n\n" and decode_escapes(r"a\tb\\n") == "a\tb\\n"
    assert decode_escapes(r"\x41\u00e9 é") == "Aé é"
    with pytest.raises(UserError, match=r"unknown escape \\q"):
        decode_escapes(r"\q")


def test_generate_decodes_a_jsonl_batch_and_reports_its_speed(tmp_path, capsys):
    from mhar_lit.generation.cli import generate_main

    ckpt = _checkpoint(tmp_path / "m.ckpt")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"def f("\n\n{"prompt": "import os"}\n')
    assert generate_main(["--ckpt", str(ckpt), "--prompts_jsonl", str(prompts), "--max_new_tokens", "3"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(", "import os"] and all("completion" in r for r in rows)
    assert "tokens/s" in err and "batch 2" in err
    prompts.write_text('{"text": "x"}\n')
    assert generate_main(["--ckpt", str(ckpt), "--prompts_jsonl", str(prompts)]) == 2
    assert 'p.jsonl:1: expected a JSON string or an object with a "prompt" string' in capsys.readouterr().err


def test_perplexity_refuses_what_it_cannot_score_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    ckpt = _checkpoint(tmp_path / "m.ckpt")
    err = _main_error(["perplexity", "--ckpt", str(ckpt), "--data", str(tmp_path / "none.txt")], capsys)
    assert "--data" in err and "none.txt: no such file or folder" in err
    (tmp_path / "blank.txt").write_text("")
    err = _main_error(["perplexity", "--ckpt", str(ckpt), "--text_file", str(tmp_path / "blank.txt")], capsys)
    assert "is empty: nothing to score" in err
    err = _main_error(["perplexity", "--ckpt", str(tmp_path / "no.ckpt"), "--data", str(tmp_path / "blank.txt")],
                      capsys)
    assert "no.ckpt: neither a checkpoint file nor a converted model directory" in err
    err = _main_error(["perplexity", "--ckpt", str(ckpt), "--data", "x", "--batch_size", "0"], capsys)
    assert "--batch_size" in err and "must be >= 1" in err


# ----------------------------------------------------------------------------- stores, sweeps, secrets
def test_a_truncated_mlflow_store_is_one_line_with_a_repair_hint(tmp_path, capsys):
    from mhar_lit.sweep import compare_main
    from mhar_lit.tracking import prepare_store

    store = tmp_path / "mlflow.db"
    prepare_store(f"sqlite:///{store}")
    capsys.readouterr()
    store.write_bytes(store.read_bytes()[: store.stat().st_size // 3])
    assert compare_main(["--sweep", "x", "--tracking_uri", f"sqlite:///{store}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the MLflow store {store} cannot be read" in err and ".recover" in err


def test_a_sweep_checks_every_grid_point_before_its_first_fit(tmp_path, capsys, monkeypatch):
    """A grid naming a missing config trained the earlier points, then failed; --dry_run passed it."""
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    methods = f"config={REPO}/configs/methods/baseline.yaml,{tmp_path}/missing.yaml"
    for dry in ([], ["--dry_run"]):
        err = _main_error(["sweep", "--config", str(REPO / "configs/demo.yaml"), "--grid", methods, *dry, "--",
                           *tiny_fit_args(tmp_path)[2:]], capsys)
        assert "grid point missing" in err and "missing.yaml" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_a_sweep_that_cannot_validate_is_warned_and_its_uri_password_never_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = "http://alice:S3cretPw@127.0.0.1:9"
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(REPO / "configs/demo.yaml"), "--dry_run", "--tracking_uri", uri,
              "--", "--trainer.max_steps", "30"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    assert "S3cretPw" not in out + err and "alice:***@127.0.0.1" in out
    assert "will never validate (trainer.val_check_interval 50 > trainer.max_steps 30)" in err


def test_a_traceback_never_shows_a_uri_password(capsys):
    from mhar_lit.cli import redacting_excepthook

    try:
        raise ConnectionError("cannot reach https://bob:hunter2@mlflow.example/api")
    except ConnectionError as err:
        redacting_excepthook(type(err), err, err.__traceback__)
    err = capsys.readouterr().err
    assert "hunter2" not in err and "bob:***@mlflow.example" in err and "Traceback" in err


def test_a_fit_ends_with_where_its_run_went(tmp_path, capsys, monkeypatch):
    from mhar_lit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(tiny_fit_args(tmp_path, "--trainer.max_steps", "3", "--run_name", "where"), run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    printed = capsys.readouterr().out
    run_id = cli.trainer.logger.run_id
    assert f"fit done: run where (MLflow id {run_id}), 3 steps" in printed
    assert "train/loss " in printed and "val/loss " in printed and "tokens/s" in printed
    assert f"checkpoint {tmp_path}/runs/where/checkpoints/last.ckpt" in printed
    assert "UI: make ui, then http://127.0.0.1:5000/#/experiments/" in printed and run_id in printed


def test_lm_eval_with_a_missing_model_path_is_one_line(tmp_path, capsys, monkeypatch):
    """lm_eval's model arguments are checked by the adapter: a path that does not exist is the one-line user error
    (exit 2) of every command, not lm_eval's traceback."""
    pytest.importorskip("lm_eval")
    monkeypatch.delenv("MHAR_DEBUG", raising=False)
    missing = tmp_path / "missing"
    err = _main_error(["lm_eval", "--model", "mhar_lit", "--model_args", f"path={missing}", "--tasks",
                       "lambada_openai"], capsys)
    assert f"path={missing}: neither a checkpoint file nor a converted model directory" in err
