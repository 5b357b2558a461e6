"""`ppo serve` through crashes: its worker killed with the flow run it started, its Prefect server killed mid-run.

`ppo serve` starts a dead worker or server again; the next deployment run of
the PPO run marks the killed flow run CRASHED and resumes from the finished
phases; a flow run that outlives a server restart ends COMPLETED.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flow_process import digest, flow_runs, release, tiny_overrides, unfinished_flow_runs
from local_servers import BIN, free_port, processes_mentioning, start_ppo_serve
from ppo_core import pipeline
from ppo_core.config import PROJECT_ROOT, PPOConfig

pytestmark = pytest.mark.slow
PAUSE_AT = "iter=0001/train/train.step#1,iter=0002/rollout/generate.step#1"


@pytest.fixture
def served(tmp_path, tmp_path_factory):
    port, home = free_port(), tmp_path / "prefect-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PPO_KILL", "PPO_PAUSE", "MLFLOW_TRACKING"))}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PPO_PAUSE_AT=PAUSE_AT,
               PPO_PAUSE_FILE=str(tmp_path / "pause"),
               PPO_ALLOWED_ROOTS=os.pathsep.join([str(tmp_path_factory.getbasetemp()), str(PROJECT_ROOT / "data")]))
    proc = start_ppo_serve(env, port)
    yield env, proc
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while _serve_processes(home, "") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _serve_processes(home, "") == [], "ppo serve left processes behind"


def _serve_processes(home: Path, command: str) -> list[int]:
    """Pids of the processes `ppo serve` started (they carry its PREFECT_HOME) whose command line holds ``command``."""
    mine = {pid for pid, _ in processes_mentioning(str(home), "environ")} - {os.getpid()}
    return sorted(pid for pid, cmdline in processes_mentioning(command) if pid in mine)


def _submit(env: dict, params: dict) -> None:
    out = subprocess.run([str(BIN / "prefect"), "deployment", "run", "ppo/iterate", "--params", json.dumps(params)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def _wait_for(what: str, check, serve: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; ppo serve said:\n" + "".join(serve.lines[-150:])
        time.sleep(0.5)


def test_a_killed_worker_and_a_killed_server_are_started_again_and_the_run_recovers(served, tiny_cfg, tmp_path):
    env, serve = served
    home, pause = Path(env["PREFECT_HOME"]), Path(env["PPO_PAUSE_FILE"])
    cfg = tiny_cfg(run="recover")
    params = {"run": "recover", "until": 2, "overrides": tiny_overrides(Path(cfg.model), cfg.artifact_root)}

    # 1. the worker dies with the flow run it started (a container or machine kill), during iteration 1's training
    _submit(env, params)
    _wait_for("the flow run to reach iteration 1's training", lambda: pause.is_file() and pause.read_text().strip(), serve)
    flow_pid = int(pause.read_text())
    finished = {p: p.stat().st_mtime_ns for p in cfg.layout.phase_record(1, "rollout").parent.glob("*.json")}
    assert {p.stem for p in finished} == {"rollout", "attribute", "reward", "value", "advantage"}
    [worker] = _serve_processes(home, "worker start --pool")
    os.killpg(os.getpgid(worker), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(flow_pid, signal.SIGKILL)
    _wait_for("ppo serve to start the worker again", lambda: any("Prefect worker is back" in line for line in serve.lines), serve)
    assert any("the Prefect worker exited with code -9; starting it again" in line for line in serve.lines)
    # the flow run that died with it is marked at once: it no longer holds the deployment's concurrency slot
    _wait_for("ppo serve to mark the dead flow run", lambda: any("CRASHED: its process" in line for line in serve.lines), serve)

    # 2. the next deployment run resumes; the Prefect server is killed while it runs, and ppo serve brings it back
    _submit(env, params)
    second_pause = Path(f"{pause}.1")
    _wait_for("the resumed flow run to reach iteration 2", lambda: second_pause.is_file() and second_pause.read_text().strip(), serve,
              timeout=120)
    [server] = _serve_processes(home, "flows.prefect_app:create_app")
    os.killpg(os.getpgid(server), signal.SIGKILL)
    _wait_for("ppo serve to start the server again", lambda: any("Prefect server is back" in line for line in serve.lines), serve)
    release(second_pause)
    _wait_for("every flow run to end", lambda: not unfinished_flow_runs(env["PREFECT_API_URL"]), serve, timeout=600)

    first, second = flow_runs(env["PREFECT_API_URL"])
    assert first["state_type"] == "CRASHED" and "the worker that started it died" in first["state"]["message"]
    assert second["state_type"] == "COMPLETED", second["state"]
    assert cfg.layout.completed_iterations() == [0, 1, 2]
    assert all(p.stat().st_mtime_ns == t for p, t in finished.items()), "a phase finished before the kill was recomputed"
    reference = PPOConfig(**{**cfg.to_json_dict(), "artifact_root": str(tmp_path / "reference")})
    pipeline.run(reference, 2)
    assert digest(cfg.layout.run_dir) == digest(reference.layout.run_dir)
