"""docker/: MLflow on loopback only and reachable as http://mlflow:5000, the data cache on a volume, a small context.

No docker daemon is needed: the files are parsed and checked against the rules that docker and MLflow apply.
"""

import fnmatch
import importlib.util
import inspect
import re
import shlex
from pathlib import Path

import yaml

from mhar_lit.data.datamodule import TokenDataModule

REPO = Path(__file__).resolve().parents[1]


def compose():
    return yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())


def dockerfile_instructions(name):
    lines = (REPO / "docker" / "Dockerfile").read_text().splitlines()
    return [line.split(None, 1)[1] for line in lines if line.startswith(name + " ")]


def mlflow_host_check():
    """MLflow's own Host-header rule (mlflow/server/security_utils.py), loaded without the server's flask imports."""
    package = Path(importlib.util.find_spec("mlflow").origin).parent
    spec = importlib.util.spec_from_file_location("mlflow_security_utils", package / "server" / "security_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.is_allowed_host_header


def test_mlflow_is_published_on_loopback_only():
    ports = compose()["services"]["mlflow"]["ports"]
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports)


def test_mlflow_accepts_the_train_containers_host_header():
    args = shlex.split(compose()["services"]["mlflow"]["command"])
    hosts = args[args.index("--allowed-hosts") + 1].split(",")
    allowed = mlflow_host_check()
    assert allowed(hosts, "mlflow:5000")  # what http://mlflow:5000 sends from the train container
    assert allowed(hosts, "localhost:5000") and allowed(hosts, "127.0.0.1:5000")  # the UI through the port
    assert not allowed(hosts, "attacker.example:5000")
    assert compose()["services"]["train"]["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


def test_the_prepared_data_cache_is_on_a_volume():
    workdir = dockerfile_instructions("WORKDIR")[-1].strip()
    default_cache = inspect.signature(TokenDataModule).parameters["cache_dir"].default
    cache_path = f"{workdir}/{default_cache}"
    mounts = dict(v.rsplit(":", 1)[::-1] for v in compose()["services"]["train"]["volumes"])
    assert cache_path in mounts and mounts[cache_path] in compose()["volumes"]
    declared = yaml.safe_load(dockerfile_instructions("VOLUME")[-1])
    assert cache_path in declared


def docker_ignores(path, rules):
    """Docker's rule: the last pattern matching the path or one of its parent folders decides ('!' re-includes)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for rule in rules:
        negate, pattern = rule.startswith("!"), rule.lstrip("!")
        patterns = [pattern] + ([pattern[3:], "*/" + pattern[3:]] if pattern.startswith("**/") else [])
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns):
            excluded = not negate
    return excluded


def test_dockerignore_sends_only_the_sources():
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    for heavy in (".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/objects/ab/cd", "mlruns/1/meta.yaml",
                  "mlflow.db", "data_cache/tokens-0/train/chunk-0-0.bin", "runs/1/x/checkpoints/last.ckpt",
                  "mhar_lit/__pycache__/cli.cpython-311.pyc"):
        assert docker_ignores(heavy, rules), heavy
    copied = [src for line in dockerfile_instructions("COPY") for src in line.split()[:-1]]
    assert copied  # every source the Dockerfile copies is in the context
    for source in copied + ["mhar_lit/data/prepare.py", "configs/demo.yaml"]:
        assert not docker_ignores(source, rules), source
    assert not any(re.match(r"!\.venv|!\.git\b", r) for r in rules)


def test_the_default_command_trains_on_the_gpu_and_parses():
    """The image's CMD, as the entrypoint runs it, parses with the real CLI and does not pin the CPU (the demo
    config does, for laptops)."""
    import json

    import pytest

    from mhar_lit.cli import build_cli

    cmd = json.loads(dockerfile_instructions("CMD")[-1])
    assert json.loads(dockerfile_instructions("ENTRYPOINT")[-1]) == ["python", "-m", "mhar_lit"] and cmd[0] == "fit"
    with pytest.raises(SystemExit) as done:
        build_cli([*cmd[1:], "--print_config"], run=False)
    assert done.value.code in (0, None)
    assert cmd[cmd.index("--trainer.accelerator") + 1] == "auto"


def test_the_image_installs_the_eval_extra_and_train_waits_for_a_healthy_mlflow():
    assert any("[triton,eval]" in line for line in dockerfile_instructions("RUN"))
    services = compose()["services"]
    assert services["train"]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    check = services["mlflow"]["healthcheck"]["test"]
    assert check[0] == "CMD" and "http://localhost:5000/health" in " ".join(check)


def test_the_data_folder_defaults_to_the_repository_root():
    """Compose resolves relative host paths from the compose file's folder (docker/)."""
    data = next(v for v in compose()["services"]["train"]["volumes"] if v.endswith(":/data"))
    default = data.split(":-", 1)[1].split("}", 1)[0]
    assert (REPO / "docker" / default).resolve() == REPO / "data"
