"""Servers that go away in the middle of a run: a real MLflow tracking server, a real Prefect server.

Nothing is lost: training goes on while MLflow is away and what it missed is
logged once it is back (at the end of the same flow run, or by `ppo sync`); a
Prefect server that restarts mid-run is recovered from by the next flow run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flow_process import (
    child_env, digest, flow_runs, mlflow_state, release, run_flow, start_flow, tiny_overrides, unfinished_flow_runs, wait_paused,
)
from local_servers import free_port, start_mlflow_server, start_prefect_server, stop
from ppo_core.layout import RunLayout

pytestmark = pytest.mark.slow
UNTIL = 3
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def reference(live_prefect_api, tiny_model_dir, tmp_path_factory):
    """The run uninterrupted, tracked in the embedded store: its bytes and its MLflow history."""
    root = tmp_path_factory.mktemp("reference")
    assert run_flow("away", UNTIL, tiny_overrides(tiny_model_dir, root), root / "flow.log", PREFECT_API_URL=live_prefect_api) == 0
    return digest(root / "run=away"), mlflow_state("away", root)


def _mlflow(tmp_path: Path):
    store, port = tmp_path / "mlflow-server.db", free_port()
    return store, port, f"http://127.0.0.1:{port}"


def test_mlflow_server_away_until_the_end_then_ppo_sync_logs_everything(live_prefect_api, reference, tiny_model_dir, tmp_path):
    store, port, uri = _mlflow(tmp_path)
    server = start_mlflow_server(store, port)
    root, pause, log = tmp_path / "artifacts", tmp_path / "pause", tmp_path / "flow.log"
    flow = start_flow("away", UNTIL, tiny_overrides(tiny_model_dir, root), log, PREFECT_API_URL=live_prefect_api,
                      MLFLOW_TRACKING_URI=uri, PPO_PAUSE_AT="iter=0002/rollout/generate.step#1", PPO_PAUSE_FILE=str(pause))
    wait_paused(pause, flow, log)
    stop(server)  # iteration 1 is logged; the server goes away during iteration 2's rollout
    release(pause)
    assert flow.wait(timeout=900) != 0
    output = log.read_text()
    assert "is unreachable" in output and "training goes on" in output
    assert "`ppo sync --run away` logs them" in output, output[-3000:]
    # training went on: every table and adapter of iterations 2 and 3 is there, byte for byte
    ref_digest, ref_mlflow = reference
    assert digest(root / "run=away") == ref_digest

    server = start_mlflow_server(store, port)  # back, on the same store
    try:
        synced = subprocess.run([str(BIN / "ppo"), "sync", "--run", "away", "--root", str(root)],
                                env=child_env(MLFLOW_TRACKING_URI=uri), capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert "logged iterations 2, 3" in synced.stdout
        state = mlflow_state("away", root, uri)
    finally:
        stop(server)
    assert state["metrics"] == ref_mlflow["metrics"]  # every point, once
    assert state["versions"] == ref_mlflow["versions"] and state["status"] == "FINISHED"


def test_mlflow_server_back_mid_run_catches_up_in_the_same_flow_run(live_prefect_api, reference, tiny_model_dir, tmp_path):
    store, port, uri = _mlflow(tmp_path)
    server = start_mlflow_server(store, port)
    root, pause, log = tmp_path / "artifacts", tmp_path / "pause", tmp_path / "flow.log"
    flow = start_flow("away", UNTIL, tiny_overrides(tiny_model_dir, root), log, PREFECT_API_URL=live_prefect_api,
                      MLFLOW_TRACKING_URI=uri, PPO_PAUSE_FILE=str(pause),
                      PPO_PAUSE_AT="iter=0002/rollout/generate.step#1,report/table.write:report.html#1")
    wait_paused(pause, flow, log)
    stop(server)
    release(pause)
    # back only after the last iteration: iterations 2 and 3 are both logged before the registration
    wait_paused(Path(f"{pause}.1"), flow, log)
    server = start_mlflow_server(store, port)
    try:
        release(Path(f"{pause}.1"))
        assert flow.wait(timeout=900) == 0, log.read_text()[-4000:]
        state = mlflow_state("away", root, uri)
    finally:
        stop(server)
    output = log.read_text()
    assert "is unreachable" in output and "answers again" in output
    ref_digest, ref_mlflow = reference
    assert digest(root / "run=away") == ref_digest
    assert state["metrics"] == ref_mlflow["metrics"]
    assert state["versions"] == ref_mlflow["versions"] and state["status"] == "FINISHED"


def test_prefect_server_restarting_mid_run_loses_nothing(reference, tiny_model_dir, tmp_path):
    """Back within seconds: the flow run goes on and ends COMPLETED. Away until the flow run ends: the work is
    done, only its final state is lost, and the next flow run of the PPO run records it, recomputing nothing."""
    home, port = tmp_path / "prefect-home", free_port()
    api = f"http://127.0.0.1:{port}/api"
    server = start_prefect_server(home, port)
    root, log = tmp_path / "artifacts", tmp_path / "flow.log"
    pause = tmp_path / "pause"
    # a client that gives up quickly: the test need not wait out Prefect's default retries (minutes)
    quick = {"PREFECT_API_URL": api, "PREFECT_CLIENT_MAX_RETRIES": "1"}
    flow = start_flow("away", UNTIL, tiny_overrides(tiny_model_dir, root), log, **quick, PPO_PAUSE_FILE=str(pause),
                      PPO_PAUSE_AT="iter=0001/rollout/generate.step#1,iter=0002/rollout/generate.step#1")
    wait_paused(pause, flow, log)
    stop(server, signal.SIGKILL)
    release(pause)  # iteration 1 runs on while the server is down
    server = start_prefect_server(home, port)  # and comes back during it
    wait_paused(Path(f"{pause}.1"), flow, log)
    stop(server, signal.SIGKILL)
    release(Path(f"{pause}.1"))  # iterations 2 and 3 and the flow run's end: no server at all
    # the flow run's body ends; Prefect then tries for minutes to deliver its queued events before the
    # process exits: what a user would stop with Ctrl-C, and as safe (the run's lock is released)
    deadline = time.monotonic() + 300
    while not re.search(r"Flow run .* Finished in state", log.read_text()) and flow.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "released (completed)" in RunLayout(root, "away").lock.read_text()
    os.killpg(flow.pid, signal.SIGKILL)
    flow.wait()
    ref_digest, _ = reference
    assert digest(root / "run=away") == ref_digest  # all the work was done

    server = start_prefect_server(home, port)
    try:
        [stale] = flow_runs(api)
        assert stale["state_type"] == "RUNNING"  # what Prefect shows: the final state never arrived
        records = {p: p.stat().st_mtime_ns for p in (root / "run=away").rglob("phases/*.json")}
        assert run_flow("away", UNTIL, tiny_overrides(tiny_model_dir, root), tmp_path / "again.log", **quick) == 0
        assert all(p.stat().st_mtime_ns == t for p, t in records.items()), "a finished phase was recomputed"
        runs = {r["id"]: r for r in flow_runs(api)}
        assert unfinished_flow_runs(api) == []
    finally:
        stop(server)
    settled = runs[stale["id"]]["state"]
    assert settled["type"] == "COMPLETED" and "finished while the Prefect server could not be told" in settled["message"]
