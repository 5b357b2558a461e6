"""The MLflow UI (started by `ppo ui`) in a real headless browser: two runs with different β compared.

Screenshots land in test-artifacts/ for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flows.ppo import ppo
from ppo_core import track
from ppo_core.config import load_config
from local_servers import free_port, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]
BETAS = (0.02, 0.5)


@pytest.fixture
def two_runs(tiny_cfg):
    """Two 2-iteration PPO runs differing only in β (kl_coef), in one artifact root."""
    base = tiny_cfg()
    overrides = {"model": base.model, "artifact_root": str(base.artifact_root), "batch_size": 6, "max_new_tokens": 8,
                 "score_batch_size": 4, "ppo_epochs": 2, "num_minibatches": 2, "eval_size": 4, "eval_max_new_tokens": 6,
                 "lora_layers": 1}
    names = []
    for beta in BETAS:
        name = f"beta-{beta}"
        ppo(run=name, iterations=2, overrides={**overrides, "kl_coef": beta})
        names.append(name)
    return load_config(overrides={**overrides, "run": names[0]}), names


@pytest.fixture
def mlflow_ui(two_runs):
    cfg, _ = two_runs
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("ppo")), "ui", "--root", str(cfg.artifact_root), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        # inherited settings that would switch MLflow's host/origin checks off: `ppo ui` drops them
        env={**os.environ, "MLFLOW_SERVER_DISABLE_SECURITY_MIDDLEWARE": "true", "MLFLOW_SERVER_ALLOWED_HOSTS": "*"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _server_errors(page) -> list[str]:
    failures: list[str] = []
    page.on("response", lambda r: failures.append(f"{r.status} {r.url}") if r.status >= 500 else None)
    page.on("pageerror", lambda exc: failures.append(f"page error: {exc}"))
    return failures


def test_chart_view_overlays_both_runs_and_compare_page_shows_beta(mlflow_ui, two_runs, chromium, test_artifacts):
    url, proc = mlflow_ui
    cfg, names = two_runs
    mlf = track.client(cfg)
    exp_id = mlf.get_experiment_by_name(track.EXPERIMENT).experiment_id
    runs = {r.info.run_name: r for r in mlf.search_runs([exp_id])}
    assert sorted(runs) == sorted(names)

    # the URL `ppo ui` prints is the chart view of the PPO experiment
    printed = proc.stdout.readline()
    chart_url = re.search(r"(http://\S+)", printed).group(1)
    assert chart_url.startswith(url) and "compareRunsMode=CHART" in chart_url

    page = chromium.new_page(viewport={"width": 1500, "height": 1000})
    errors = _server_errors(page)
    page.goto(chart_url)
    for name in names:
        page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
    # the first screen: reward, KL, shaped reward and eval curves, nothing before them
    search = page.get_by_placeholder("Search metric charts")
    search.wait_for(timeout=60_000)
    assert search.input_value() == track.FIRST_SCREEN_CHARTS
    for metric in ("reward/score", "reward/kl", "reward/reward", "evaluate/eval_score"):
        page.get_by_text(f"{names[0]} ({metric})").first.wait_for(timeout=30_000)
    assert page.get_by_text(f"{names[0]} (attribute/entropy)").count() == 0
    page.screenshot(path=str(test_artifacts / "mlflow-first-screen.png"), full_page=True)
    # the KL curve of each run is drawn in one overlaid chart
    page.get_by_placeholder("Search metric charts").fill("reward/kl")
    for name in names:
        page.get_by_text(f"{name} (reward/kl)").first.wait_for(timeout=30_000)
    chart = page.locator("canvas, svg.main-svg").first
    chart.wait_for(timeout=30_000)
    box = chart.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 100
    page.screenshot(path=str(test_artifacts / "mlflow-chart-view.png"), full_page=True)

    # the second URL `ppo ui` prints opens the latest run on its curves (model metrics), not its overview
    printed = proc.stdout.readline()
    run_url = re.search(r"(http://\S+)", printed).group(1)
    assert f"'{names[-1]}'" in printed and f"/runs/{runs[names[-1]].info.run_id}/model-metrics" in run_url
    page.goto(run_url)
    run_search = page.get_by_placeholder("Search metric charts")  # only the model-metrics tab has it
    run_search.wait_for(timeout=60_000)
    run_search.fill("reward/kl")
    page.get_by_text(f"{names[-1]} (reward/kl)").first.wait_for(timeout=30_000)
    page.screenshot(path=str(test_artifacts / "mlflow-run-model-metrics.png"), full_page=True)
    assert "Model training" in page.inner_text("body")

    ids = json.dumps([runs[n].info.run_id for n in names])
    page.goto(f"{url}/#/compare-runs?runs={ids}&experiments={json.dumps([exp_id])}")
    page.get_by_text("Comparing 2 Runs").wait_for(timeout=60_000)
    body = page.inner_text("body")
    kl_row = re.search(r"kl_coef\t(\S+)\t(\S+)", body)
    assert kl_row and {float(v) for v in kl_row.groups()} == set(BETAS), body[:3000]
    # the metrics grid is virtualised (only the first rows are in the DOM): check rows near the top
    for metric in ("reward/kl", "reward/score", "attribute/entropy", "advantage/explained_variance"):
        assert page.get_by_text(metric, exact=True).count() >= 1, metric
    page.screenshot(path=str(test_artifacts / "mlflow-compare.png"), full_page=True)

    # each run's registered policy: the model page lists the version with its provenance tags
    page.goto(f"{url}/#/models/ppo-{names[0]}")
    page.get_by_text("Version 1", exact=True).wait_for(timeout=60_000)
    body = page.inner_text("body")
    assert "iteration" in body and "adapter_sha256" in body and "lora_rank" in body, body[:3000]
    page.screenshot(path=str(test_artifacts / "mlflow-registered-model.png"), full_page=True)

    # the run's HTML report, logged by the flow, opens in MLflow's artifact viewer
    page.goto(f"{url}/#/experiments/{exp_id}/runs/{runs[names[1]].info.run_id}/artifacts/report.html")
    report = page.frame_locator("iframe").first
    report.get_by_text(f"PPO run {names[1]}").wait_for(timeout=60_000)
    assert report.locator("#fig-batch-heatmap svg").count() == 1
    page.screenshot(path=str(test_artifacts / "mlflow-report-artifact.png"), full_page=True)
    assert errors == []


def test_the_ui_refuses_a_rebound_host_and_a_cross_site_origin(mlflow_ui):
    import urllib.error
    import urllib.request

    url, _ = mlflow_ui
    port = url.rsplit(":", 1)[1]

    def status(headers: dict) -> int:  # a state-changing method: what a cross-site page would need
        req = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search", method="POST", data=b'{"max_results": 1}',
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status({}) == 200
    assert status({"Host": f"rebound.example:{port}"}) in (400, 403)
    assert status({"Origin": "http://evil.example"}) in (400, 403)
