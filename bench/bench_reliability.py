"""Reliability figures: kills survived through the real stack (Prefect server, MLflow store, tiny model).

Two kinds of kill, each repeated until the run finishes, then checked against
an uninterrupted run (tables and adapters byte for byte, MLflow metric
histories point for point, one registered version, no temporary file, no
flow run left RUNNING):

- fail points: labels drawn at random from an uninterrupted run's trace
  (``tests/flow_process.draw_kill_points``, as ``tests/test_kill_chain.py`` draws them), several seeds;
- wall clock: the flow's process group SIGKILLed at a uniformly random moment
  of its life, wherever it is (inside MLflow's SQLite writes, Prefect's client,
  imports), again and again until a start is left to finish.

    .venv/bin/python bench/bench_reliability.py --seeds 5 --points 30 --timed 40
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import ppo_core  # noqa: E402,F401  (OpenBLAS before mlx)
from flow_process import (  # noqa: E402
    digest, draw_kill_points, mlflow_state, run_flow, start_flow, tiny_overrides, unfinished_flow_runs,
)
from local_servers import free_port, start_prefect_server, stop  # noqa: E402
from ppo_core.tiny import make_tiny_model  # noqa: E402

UNTIL = 2


def check(root: Path, reference: Path, api: str) -> list[str]:
    """What differs from the uninterrupted run (empty: survived)."""
    problems = []
    if digest(root / "run=chain") != digest(reference / "run=chain"):
        problems.append("tables or adapters differ")
    if list((root / "run=chain").rglob(".*.tmp*")):
        problems.append("temporary files left")
    got, want = mlflow_state("chain", root), mlflow_state("chain", reference)
    if got["metrics"] != want["metrics"]:
        problems.append("MLflow metric histories differ")
    if got["versions"] != want["versions"] or got["status"] != "FINISHED":
        problems.append(f"registry/status differ: {got['versions']} {got['status']}")
    if unfinished_flow_runs(api):
        problems.append("a flow run left unfinished")
    return problems


def fail_point_chain(model: Path, work: Path, api: str, reference: Path, trace: list[str], points: int, seed: int) -> tuple[int, list[str]]:
    root = work / f"points-{seed}"
    armed, kills = draw_kill_points(trace, points, seed), 0
    while armed:
        t = work / f"points-{seed}-{kills}.trace"
        rc = run_flow("chain", UNTIL, tiny_overrides(model, root), work / "last.log", PREFECT_API_URL=api,
                      PPO_FAULT_TRACE=str(t), PPO_KILL_AT=",".join(armed), PPO_KILL_GROUP="1")
        if rc == 0:
            return kills, [f"finished without reaching {armed}"]
        reached = t.read_text().split()[-1]
        armed = armed[armed.index(reached) + 1 :]
        kills += 1
    run_flow("chain", UNTIL, tiny_overrides(model, root), work / "last.log", PREFECT_API_URL=api)
    return kills, check(root, reference, api)


def timed_chain(model: Path, work: Path, api: str, reference: Path, kills: int, life: float, seed: int) -> tuple[int, list[str]]:
    """Kill the flow's process group at random moments in [0.5, life] s of its life, ``kills`` times."""
    rng, root, done = random.Random(seed), work / f"timed-{seed}", 0
    while done < kills:
        proc = start_flow("chain", UNTIL, tiny_overrides(model, root), work / "last.log", PREFECT_API_URL=api)
        try:
            proc.wait(timeout=rng.uniform(0.5, life))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            done += 1
            continue
        if proc.returncode != 0:
            return done, [f"a start failed with {proc.returncode}: {(work / 'last.log').read_text()[-2000:]}"]
        return done, check(root, reference, api)  # it finished before its moment came: the chain ends here
    run_flow("chain", UNTIL, tiny_overrides(model, root), work / "last.log", PREFECT_API_URL=api)
    return done, check(root, reference, api)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="fail-point chains, one seed each")
    ap.add_argument("--points", type=int, default=30, help="kill points drawn per chain")
    ap.add_argument("--timed", type=int, default=40, help="wall-clock kills in all (chains of 8)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ppo-reliability-"))
    model = make_tiny_model(work / "tiny")
    port = free_port()
    server = start_prefect_server(work / "prefect-home", port)
    api = f"http://127.0.0.1:{port}/api"
    try:
        reference = work / "reference"
        t0 = time.monotonic()
        run_flow("chain", UNTIL, tiny_overrides(model, reference), work / "ref.log", PREFECT_API_URL=api,
                 PPO_FAULT_TRACE=str(work / "ref.trace"))
        life = time.monotonic() - t0
        trace = (work / "ref.trace").read_text().split()
        print(f"uninterrupted flow run: {life:.1f}s, {len(trace)} fail points")
        total, failures = 0, []
        for seed in range(args.seeds):
            kills, problems = fail_point_chain(model, work, api, reference, trace, args.points, seed)
            total += kills
            failures += [f"fail points seed {seed}: {p}" for p in problems]
            print(f"fail points, seed {seed}: {kills} kills, {'survived' if not problems else problems}")
        timed_total = 0
        seed = 0
        while timed_total < args.timed:
            kills, problems = timed_chain(model, work, api, reference, min(8, args.timed - timed_total), life, 1000 + seed)
            timed_total += kills
            failures += [f"timed seed {1000 + seed}: {p}" for p in problems]
            print(f"wall clock, seed {1000 + seed}: {kills} kills, {'survived' if not problems else problems}")
            seed += 1
        print(f"\nfail-point kills survived: {total} in {args.seeds} chains; wall-clock kills survived: {timed_total}")
        print("FAILURES:\n  " + "\n  ".join(failures) if failures else "no failure")
    finally:
        stop(server)


if __name__ == "__main__":
    main()
