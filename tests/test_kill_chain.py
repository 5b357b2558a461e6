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

import os
import signal
import time

import pytest

from flow_process import digest, draw_kill_points, kill_point_kind, mlflow_state, run_flow, tiny_overrides, unfinished_flow_runs

pytestmark = pytest.mark.slow
SEED = int(os.environ.get("PPO_KILL_SEED", "20261124"))
KILLS = int(os.environ.get("PPO_KILL_POINTS", "22"))
UNTIL = 2


def test_twenty_random_kills_through_prefect_and_mlflow_leave_the_uninterrupted_run(live_prefect_api, tiny_model_dir, tmp_path):
    ref_root, root = tmp_path / "uninterrupted", tmp_path / "killed"

    def flow(root, name: str, **env) -> int:
        trace = tmp_path / f"{name}.trace"
        return run_flow("chain", UNTIL, tiny_overrides(tiny_model_dir, root), tmp_path / f"{name}.log",
                        PREFECT_API_URL=live_prefect_api, PPO_FAULT_TRACE=str(trace), **env)

    t0 = time.monotonic()
    assert flow(ref_root, "reference") == 0
    one_run = time.monotonic() - t0
    trace = (tmp_path / "reference.trace").read_text().split()
    assert len(trace) == len(set(trace)), "fail point labels of one run must be unique"
    kinds = {kill_point_kind(label) for label in trace}
    assert {"init", "rollout", "attribute", "reward", "value", "advantage", "train", "evaluate", "manifest", "mlflow",
            "registry", "report", "finish", "start"} <= kinds, kinds

    points = draw_kill_points(trace, KILLS, SEED)
    print(f"\nseed {SEED}: {len(points)} kill points of {len(trace)} fail points (one uninterrupted run: {one_run:.0f}s)")
    armed, killed_at = list(points), []
    reference = digest(ref_root / "run=chain")
    while armed:
        name = f"attempt-{len(killed_at) + 1}"
        rc = flow(root, name, PPO_KILL_AT=",".join(armed), PPO_KILL_GROUP="1")
        reached = (tmp_path / f"{name}.trace").read_text().split()
        assert rc == -signal.SIGKILL, f"{name} finished without reaching any of {armed}"
        assert reached[-1] in armed, f"{name} died at {reached[-1]}, which was not armed"
        print(f"  kill {len(killed_at) + 1:2d}: {reached[-1]}")
        killed_at.append(reached[-1])
        armed = armed[armed.index(reached[-1]) + 1 :]  # a point the resumed work never reaches again is passed
        # no half file under a final name, ever: whatever exists matches the uninterrupted bytes
        assert all(reference.get(n) == h for n, h in digest(root / "run=chain").items())
    assert len(killed_at) >= min(KILLS, 20), f"only {len(killed_at)} of the drawn points were reached: {killed_at}"
    assert flow(root, "final") == 0

    assert digest(root / "run=chain") == reference
    assert not list((root / "run=chain").rglob(".*.tmp*")), "a killed process's temporary file was left behind"
    got, want = mlflow_state("chain", root), mlflow_state("chain", ref_root)
    assert got["metrics"] == want["metrics"]
    assert len(got["versions"]) == 1 and got["versions"] == want["versions"]
    assert got["status"] == "FINISHED" and got["params"] == want["params"] > 0
    assert unfinished_flow_runs(live_prefect_api) == [], "a killed flow run was left RUNNING"
