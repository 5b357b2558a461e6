"""SIGKILL a run at several points, resume it, and get the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from flow_process import digest, tiny_overrides

# runs until iteration argv[2] is complete: a resumed process finishes the interrupted one first
RUNNER = (
    "import json, sys, ppo_core; from ppo_core.config import PPOConfig; from ppo_core import pipeline, runs; "
    "cfg = PPOConfig(**json.loads(sys.argv[1])); pipeline.run(cfg, int(sys.argv[2]) - runs.next_iteration(cfg) + 1)"
)
ITERATIONS = 2


def _run(cfg: dict, kill_at: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PPO_KILL_AT"}
    if kill_at:
        env["PPO_KILL_AT"] = kill_at
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(cfg), str(ITERATIONS)], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(proc.stderr[-3000:])
    return proc.returncode


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    cfg = tiny_overrides(tiny_model_dir, root)
    assert _run(cfg) == 0
    return cfg, digest(root / "run=default")


@pytest.mark.parametrize(
    "kill_at",
    [
        "generate.step:3",  # inside the first rollout's sampling loop
        "phase.done:4",  # between phases (after iteration 1's reward... record written)
        "train.step:2",  # inside iteration 1's PPO epochs
        "table.write:9",  # a Parquet file fully written to its temporary name, not yet renamed
        "train.step:6",  # inside iteration 2's training
    ],
)
def test_killed_run_resumes_to_identical_bytes(kill_at, reference, tiny_model_dir, tmp_path):
    ref_cfg, ref_digest = reference
    cfg = tiny_overrides(tiny_model_dir, tmp_path)
    assert _run(cfg, kill_at) == -signal.SIGKILL, "the fail point was never reached"
    partial = digest(tmp_path / "run=default")
    finished = {p: p.stat().st_mtime_ns for p in (tmp_path / "run=default").rglob("phases/*.json") if not p.name.startswith(".")}
    assert partial != ref_digest  # it really died before the end
    # no half-written file under a final name: everything present matches the reference bytes
    assert all(ref_digest.get(name) == h for name, h in partial.items())
    assert _run(cfg) == 0
    assert digest(tmp_path / "run=default") == ref_digest
    assert not list((tmp_path / "run=default").rglob(".*.tmp*"))  # what the killed process left was cleaned up
    # the resumed process recomputed nothing that had finished: those phase records are untouched
    assert all(p.stat().st_mtime_ns == t for p, t in finished.items())
