"""Random kills through the real stack: the `ppo` flow on a real Prefect server, MLflow's store, the tiny model.

An uninterrupted flow run traces every fail point it passes (``ppo_core.faults``:
labels such as ``iter=0001/train/train.step#3``). Kill points are drawn from
that trace at random (seeded, printed; at least one from every kind of work:
each phase, manifests, MLflow logging, registration, the report), and the
same run is started again and again with the next points armed: each start
SIGKILLs its whole process group at the first armed point it reaches, the
next one resumes. At the end the run must hold the uninterrupted run's bytes
and MLflow history, one registered version, no temporary file, and Prefect no
flow run left RUNNING.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from local_servers import free_port, wait_healthy

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SEED = int(os.environ.get("PPO_KILL_SEED", "20261124"))
KILLS = int(os.environ.get("PPO_KILL_POINTS", "22"))
UNTIL = 2

FLOW = (
    "import json, sys; from flows.ppo import ppo; "
    "ppo(run='chain', until=int(sys.argv[2]), overrides=json.loads(sys.argv[1]))"
)


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A real Prefect server (its own process and SQLite database), outliving every killed flow run."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)}
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-services"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    wait_healthy(url, server)
    yield url
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)


def _overrides(model_dir: Path, root: Path) -> dict:
    return {
        "model": str(model_dir), "artifact_root": str(root), "batch_size": 6, "max_new_tokens": 8,
        "score_batch_size": 4, "ppo_epochs": 2, "num_minibatches": 2, "eval_size": 4,
        "eval_max_new_tokens": 6, "lora_layers": 1,
    }


def _flow(api: str, overrides: dict, trace: Path, log: Path, kill_at: list[str] | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PPO_KILL", "PPO_PAUSE", "MLFLOW_TRACKING"))}
    env.update(PREFECT_API_URL=api, PPO_FAULT_TRACE=str(trace))
    if kill_at:
        env.update(PPO_KILL_AT=",".join(kill_at), PPO_KILL_GROUP="1")
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-c", FLOW, json.dumps(overrides), str(UNTIL)], env=env, stdout=out, stderr=subprocess.STDOUT,
            timeout=900, start_new_session=True,  # its own process group: the kill takes that group, not pytest
        )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"flow process exited with {proc.returncode}:\n" + log.read_text()[-4000:])
    return proc.returncode


def _digest(run_dir: Path) -> dict[str, str]:
    files = sorted(p for p in run_dir.rglob("*") if p.suffix in (".parquet", ".safetensors") and not p.name.startswith("."))
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _mlflow_state(root: Path) -> dict:
    """Metric histories (time/* by step only: wall times differ between runs), versions, status, params."""
    from ppo_core import registry, track
    from ppo_core.config import PPOConfig

    cfg = PPOConfig(run="chain", artifact_root=root)
    mlf = track.client(cfg)
    run = mlf.get_run(track.ensure_run(cfg))
    histories = {}
    for key in run.data.metrics:
        points = sorted((m.step, m.value) for m in mlf.get_metric_history(run.info.run_id, key))
        histories[key] = [s for s, _ in points] if key.startswith("time/") else points
    versions = [(v.version, v.tags.get("iteration"), v.tags.get("adapter_sha256"), bool(v.description))
                for v in mlf.search_model_versions(f"name='{registry.registered_model_name(cfg)}'")]
    return {"metrics": histories, "versions": versions, "status": run.info.status, "params": len(run.data.params)}


def _unfinished_flow_runs(api: str) -> list[dict]:
    body = json.dumps({"flow_runs": {"state": {"type": {"any_": ["RUNNING", "PENDING", "SCHEDULED"]}}}}).encode()
    req = urllib.request.Request(f"{api}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _kind(label: str) -> str:
    """What a fail point interrupts: a phase, a manifest, MLflow logging, the registration, the report."""
    scope_parts = label.split("/")
    return scope_parts[1] if scope_parts[0].startswith("iter=") else scope_parts[0]


def draw_kill_points(trace: list[str], count: int, seed: int) -> list[str]:
    """``count`` distinct labels of ``trace``: one of every kind first, the rest uniformly; in trace order."""
    rng = random.Random(seed)
    by_kind: dict[str, list[str]] = defaultdict(list)
    for label in trace:
        by_kind[_kind(label)].append(label)
    chosen = {rng.choice(labels) for labels in by_kind.values()}
    rest = [label for label in trace if label not in chosen]
    chosen |= set(rng.sample(rest, max(0, min(count - len(chosen), len(rest)))))
    return [label for label in trace if label in chosen]


def test_twenty_random_kills_through_prefect_and_mlflow_leave_the_uninterrupted_run(prefect_api, tiny_model_dir, tmp_path):
    ref_root, root = tmp_path / "uninterrupted", tmp_path / "killed"
    ref_trace = tmp_path / "reference.trace"
    t0 = time.monotonic()
    assert _flow(prefect_api, _overrides(tiny_model_dir, ref_root), ref_trace, tmp_path / "reference.log") == 0
    one_run = time.monotonic() - t0
    trace = ref_trace.read_text().split()
    assert len(trace) == len(set(trace)), "fail point labels of one run must be unique"
    kinds = {_kind(label) for label in trace}
    assert {"init", "rollout", "attribute", "reward", "value", "advantage", "train", "evaluate", "manifest", "mlflow",
            "registry", "report", "finish", "start"} <= kinds, kinds

    points = draw_kill_points(trace, KILLS, SEED)
    print(f"\nseed {SEED}: {len(points)} kill points of {len(trace)} fail points (one uninterrupted run: {one_run:.0f}s)")
    armed, killed_at, attempts = list(points), [], 0
    while armed:
        attempts += 1
        attempt_trace = tmp_path / f"attempt-{attempts}.trace"
        rc = _flow(prefect_api, _overrides(tiny_model_dir, root), attempt_trace, tmp_path / f"attempt-{attempts}.log", armed)
        reached = attempt_trace.read_text().split()
        assert rc == -signal.SIGKILL, f"attempt {attempts} finished without reaching any of {armed}"
        assert reached[-1] in armed, f"attempt {attempts} died at {reached[-1]}, which was not armed"
        print(f"  kill {attempts:2d}: {reached[-1]}")
        killed_at.append(reached[-1])
        armed = armed[armed.index(reached[-1]) + 1 :]  # a point the resumed work never reaches again is passed
        # no half file under a final name, ever: whatever exists matches the uninterrupted bytes
        partial = _digest(root / "run=chain")
        assert all(_digest(ref_root / "run=chain").get(n) == h for n, h in partial.items())
    assert len(killed_at) >= min(KILLS, 20), f"only {len(killed_at)} of the drawn points were reached: {killed_at}"
    assert _flow(prefect_api, _overrides(tiny_model_dir, root), tmp_path / "final.trace", tmp_path / "final.log") == 0

    assert _digest(root / "run=chain") == _digest(ref_root / "run=chain")
    assert not list((root / "run=chain").rglob(".*.tmp*")), "a killed process's temporary file was left behind"
    got, want = _mlflow_state(root), _mlflow_state(ref_root)
    assert got["metrics"] == want["metrics"]
    assert len(got["versions"]) == 1 and got["versions"][0][1:] == want["versions"][0][1:]
    assert got["status"] == "FINISHED" and got["params"] == want["params"] > 0
    assert _unfinished_flow_runs(prefect_api) == [], "a killed flow run was left RUNNING"
