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
import random
import signal
import time
from collections import defaultdict

import pytest

from flow_process import digest, mlflow_state, run_flow, tiny_overrides, unfinished_flow_runs
from local_servers import free_port, start_prefect_server, stop

pytestmark = pytest.mark.slow
SEED = int(os.environ.get("PPO_KILL_SEED", "20261124"))
KILLS = int(os.environ.get("PPO_KILL_POINTS", "22"))
UNTIL = 2


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A real Prefect server (its own process and SQLite database), outliving every killed flow run."""
    port = free_port()
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"), port)
    yield f"http://127.0.0.1:{port}/api"
    stop(server)


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

    def flow(root, name: str, **env) -> int:
        trace = tmp_path / f"{name}.trace"
        return run_flow("chain", UNTIL, tiny_overrides(tiny_model_dir, root), tmp_path / f"{name}.log",
                        PREFECT_API_URL=prefect_api, PPO_FAULT_TRACE=str(trace), **env)

    t0 = time.monotonic()
    assert flow(ref_root, "reference") == 0
    one_run = time.monotonic() - t0
    trace = (tmp_path / "reference.trace").read_text().split()
    assert len(trace) == len(set(trace)), "fail point labels of one run must be unique"
    kinds = {_kind(label) for label in trace}
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
    assert unfinished_flow_runs(prefect_api) == [], "a killed flow run was left RUNNING"
