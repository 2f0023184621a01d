"""MLflow's web UI on a run trained by the CLI, driven in headless chromium as a user would watch it.

A 6-step demo fit on small batches (validation and the routing monitor every 3 steps) goes into a temporary
sqlite store; `mlflow ui` from `.venv-ui` (the full mlflow 3.17.2 of `make ui`) serves it on a free local port, and
Selenium drives Debian's chromium through its chromedriver. Checked: the experiment opens on its runs list
through the runs link and through the "Model training" switch that docs/training.md tells users to click
(a first visit lands on the GenAI overview),
the run page lists train/loss and val/loss, and a routing heatmap artifact is a PNG that the artifact view
renders. `make test` installs chromium, chromedriver, Selenium and `.venv-ui` (Makefile targets `browser`
and `ui-venv`); without them the test is skipped, and under CI (CI set) it fails instead.

MHAR_UPDATE_SCREENSHOT=1 also writes the run page's screenshot to docs/figures/mlflow_run_page.png.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from unittest import mock

import pytest

from mhar_lit.tracking_ui import runs_page_url

REPO = Path(__file__).resolve().parents[1]
UI_MLFLOW = REPO / ".venv-ui" / "bin" / "mlflow"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
RUN_NAME = "ui-check"
PAGE_TIMEOUT_S = 180  # the UI's first render on a loaded 2-core machine took up to ~20 s; generous margin
SCREENSHOT = REPO / "docs" / "figures" / "mlflow_run_page.png"


def _missing_tools() -> list[str]:
    missing = [f"{path} (`make browser`)" for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if not os.access(UI_MLFLOW, os.X_OK):
        missing.append(f"{UI_MLFLOW} (`make ui-venv`)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package in this Python (the test extra: `make install`)")
    return missing


@pytest.fixture(scope="module")
def browser_tools():
    missing = _missing_tools()
    if missing:
        reason = "MLflow UI browser test needs " + ", ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; `make test` installs them before the suite runs", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, browser_tools):
    """The CLI's demo fit, 6 steps of small batches, into a temporary store; returns (folder, tracking uri,
    experiment id, run id). The fit runs in this process, in that folder (what the UI shows is the store, not
    how its process started; a process of its own would add ~12 s of Lightning's import)."""
    from mhar_lit.cli import build_cli

    root = tmp_path_factory.mktemp("mlflow_ui")
    uri = f"sqlite:///{root}/mlflow.db"
    args = [
        "fit", "--config", str(REPO / "configs/demo.yaml"),
        "--trainer.max_steps", "6",
        "--trainer.val_check_interval", "3",  # val/loss at steps 3 and 6 (demo: 50)
        "--trainer.limit_val_batches", "2",
        "--trainer.log_every_n_steps", "2",  # train/loss at steps 2, 4, 6 (demo: every 10)
        "--routing_monitor.every_n_steps", "3",  # heatmaps after 3 and 6 optimizer steps (named 2, 5), plus the final one
        # what the pages show does not depend on the batch size (demo: 16 x 256 tokens)
        "--data.batch_size", "4", "--data.val_batch_size", "4", "--data.seq_len", "64",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root / "runs"),
        "--trainer.logger.init_args.tracking_uri", uri,
        "--trainer.logger.init_args.run_name", RUN_NAME,
    ]
    environ = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with contextlib.chdir(root), mock.patch.dict(os.environ, environ, clear=True):
        build_cli(args)

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("mhar_lit")
    (run,) = client.search_runs([experiment.experiment_id])
    return root, uri, experiment.experiment_id, run.info.run_id


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base: str, server: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow ui exited with {server.returncode}:\n{log.read_text()[-3000:]}", pytrace=False)
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"mlflow ui not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}", pytrace=False)


@pytest.fixture(scope="module")
def ui(trained):
    """`mlflow ui` of .venv-ui on the trained store (a free port on 127.0.0.1); returns its base URL."""
    root, uri, _, _ = trained
    port, log = _free_port(), root / "mlflow_ui.log"
    # no job runner: MLflow's server otherwise starts 7 huey consumer processes (jobs of its GenAI features, which
    # these pages do not use), each importing MLflow beside the tests
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:  # its own process group, so that stopping it also stops its uvicorn workers
        server = subprocess.Popen(
            [str(UI_MLFLOW), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server, log)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def browser(ui):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # --no-sandbox: chromium refuses to start as root (CI) with its sandbox
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1300"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser, url: str, fresh: bool = False) -> None:
    """Load `url` as a new page load (a changed #fragment alone would not reload the app). fresh: with the
    browser's stored UI choices cleared, as in a first visit; the assistant panel that MLflow opens on a
    first visit is kept closed, so that screenshots show the page."""
    browser.get(url.split("#")[0])
    if fresh:
        browser.execute_script("window.localStorage.clear()")
    browser.execute_script("window.localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
                           "window.localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false')")
    browser.get(url)
    browser.refresh()


def _wait_for(browser, condition, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, PAGE_TIMEOUT_S, poll_frequency=0.5).until(lambda d: condition(d))
    except TimeoutException:
        text = browser.execute_script("return document.body ? document.body.innerText : ''")
        pytest.fail(f"{what} not seen within {PAGE_TIMEOUT_S} s at {browser.current_url}; page text:\n"
                    f"{text[:2000]}", pytrace=False)


def _page_text(browser) -> str:
    return browser.execute_script("return document.body ? document.body.innerText : ''")


def _on_runs_list(experiment_id: str, run_name: str):
    def check(browser) -> bool:
        path = browser.current_url.split("#", 1)[-1].split("?")[0]
        return path == f"/experiments/{experiment_id}/runs" and run_name in _page_text(browser)
    return check


@pytest.mark.slow
def test_experiment_opens_on_its_runs(trained, ui, browser):
    _, _, experiment_id, _ = trained
    """The runs link and the 'Model training' switch open the experiment on its runs list."""
    # a first visit: MLflow 3.17.2 opens an experiment on its GenAI overview of traces (what docs/training.md
    # tells users to click away from); should a later MLflow open the runs list, this fails and the docs change
    _open(browser, f"{ui}/#/experiments/{experiment_id}", fresh=True)
    _wait_for(browser, lambda d: f"/experiments/{experiment_id}/overview" in d.current_url, "the GenAI overview")

    # the link the docs give: the runs list, not the GenAI overview of traces
    _open(browser, runs_page_url(ui, experiment_id), fresh=True)
    _wait_for(browser, _on_runs_list(experiment_id, RUN_NAME), "the runs list with the trained run")
    assert "No data available" not in _page_text(browser)

    # the click the docs describe: "Model training" at the top of the sidebar, remembered by the browser
    from selenium.webdriver.common.by import By

    _open(browser, f"{ui}/#/experiments", fresh=True)
    toggle = _wait_for(browser, lambda d: d.find_elements(By.XPATH, "//*[normalize-space(text())='Model training']"),
                       "the sidebar's 'Model training' switch")
    toggle[0].click()
    _open(browser, f"{ui}/#/experiments/{experiment_id}")
    _wait_for(browser, _on_runs_list(experiment_id, RUN_NAME), "the runs list after choosing 'Model training'")


@pytest.mark.slow
def test_run_page_shows_losses(trained, ui, browser, tmp_path):
    _, _, experiment_id, run_id = trained
    _open(browser, runs_page_url(ui, experiment_id, run_id), fresh=True)
    _wait_for(browser, lambda d: all(name in _page_text(d) for name in (RUN_NAME, "train/loss", "val/loss")),
              "train/loss and val/loss on the run page")
    time.sleep(1)  # let the last layout pass settle before the screenshot
    assert browser.save_screenshot(str(tmp_path / "mlflow_run_page.png"))
    if os.environ.get("MHAR_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(tmp_path / "mlflow_run_page.png", SCREENSHOT)


@pytest.mark.slow
def test_heatmap_artifact_opens(trained, ui, browser):
    root, _, experiment_id, run_id = trained
    heatmaps = sorted(p.name for p in root.glob(f"mlruns/{experiment_id}/{run_id}/artifacts/routing/heatmap_*.png"))
    assert "heatmap_final.png" in heatmaps and "heatmap_step0000002.png" in heatmaps, heatmaps  # named by the step its metrics sit at
    url = f"{ui}/get-artifact?path=routing/heatmap_final.png&run_uuid={run_id}"
    with urllib.request.urlopen(url) as response:
        assert response.read(8) == b"\x89PNG\r\n\x1a\n"

    _open(browser, runs_page_url(ui, experiment_id, run_id, "artifacts/routing/heatmap_final.png"))
    loaded = "return Array.from(document.images).filter(i => i.src.startsWith('blob:') && i.naturalWidth > 0)"
    _wait_for(browser, lambda d: d.execute_script(loaded + ".length"), "the heatmap image in the artifact view")
    width, height = browser.execute_script(loaded + ".map(i => [i.naturalWidth, i.naturalHeight])[0]")
    assert width > height > 0  # the heatmap figure: one panel per routing head, side by side


def test_runs_page_url():
    assert runs_page_url("http://127.0.0.1:5000/", "7") == \
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert runs_page_url("http://h:1", "7", "abc", "artifacts/routing/heatmap_final.png") == \
        "http://h:1/#/experiments/7/runs/abc/artifacts/routing/heatmap_final.png?workflowType=machine_learning"
    with pytest.raises(ValueError, match="needs a run_id"):
        runs_page_url("http://h:1", "7", run_tab="model-metrics")
