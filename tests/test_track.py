"""MLflow tracking stays inside each config's own store."""

from __future__ import annotations

import os

from ppo_core import track
from ppo_core.config import PPOConfig


def test_two_artifact_roots_in_one_process_keep_their_runs_apart(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a = PPOConfig(run="alpha", artifact_root=tmp_path / "a")
    b = PPOConfig(run="beta", artifact_root=tmp_path / "b")
    run_a = track.ensure_run(a)
    run_b = track.ensure_run(b)
    # re-attaching after the other store was used must find the same run, not make a new one
    assert track.ensure_run(a) == run_a and track.ensure_run(b) == run_b
    for cfg, name in ((a, "alpha"), (b, "beta")):
        mlf = track.client(cfg)
        runs = mlf.search_runs([mlf.get_experiment_by_name(track.EXPERIMENT).experiment_id])
        assert [r.info.run_name for r in runs] == [name]
    assert "MLFLOW_TRACKING_URI" not in os.environ  # nothing leaks to later runs or child processes


def test_a_tracking_server_named_in_the_environment_is_used(tmp_path, monkeypatch):
    store = tmp_path / "server.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    cfg = PPOConfig(run="remote", artifact_root=tmp_path / "root")
    track.ensure_run(cfg)
    assert store.is_file() and not (cfg.artifact_root / "mlflow.db").exists()
