"""Where tasks run: parameter checks and an unreachable cluster, before anything starts (no Ray started here)."""

from __future__ import annotations

import socket
import time

import pytest
from typer.testing import CliRunner

from local_servers import free_port
from ppo_core.config import ConfigError
from tasks.cluster import check_execution, execution, worker_env


def test_bad_execution_parameters_name_the_parameter():
    with pytest.raises(ConfigError, match="parameter 'workers' must be >= 0"):
        check_execution(-1, None, 1)
    with pytest.raises(ConfigError, match="parameter 'train_ranks' must be >= 1"):
        check_execution(0, None, 0)
    with pytest.raises(ConfigError, match="parameter 'ray_address' is empty"):
        check_execution(2, " ", 1)


def test_an_unreachable_cluster_fails_at_once_with_the_address():
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"cannot reach the Ray cluster at {address}: Connection refused"):
        with execution(2, address):
            pass
    assert time.monotonic() - t0 < 10  # Ray alone retries for minutes
    with pytest.raises(ConfigError, match="must be 'local', 'auto', host:port or ray://host:port"):
        with execution(2, "nohost"):
            pass


def test_without_workers_everything_runs_in_the_flow_process():
    with execution(0, None, 2) as runner:
        assert runner.task_runner is None and runner.shards == 1 and runner.train_ranks == 2


def test_workers_get_one_blas_thread_and_the_test_fault_points(monkeypatch):
    monkeypatch.setenv("PPO_PAUSE_AT", "generate.step")
    monkeypatch.setenv("PPO_BLAS_THREADS", "2")
    env = worker_env()
    assert env["PPO_BLAS_THREADS"] == "1" and env["PPO_PAUSE_AT"] == "generate.step"


def test_the_cli_refuses_an_unreachable_cluster_before_prefect_starts(tiny_cfg):
    from flows.cli import app

    address = f"127.0.0.1:{free_port()}"
    cfg = tiny_cfg()
    result = CliRunner().invoke(app, ["train", "--workers", "2", "--ray-address", address,
                                      "--set", f"model={cfg.model}", "--set", f"artifact_root={cfg.artifact_root}"])
    assert result.exit_code == 2
    assert f"cannot reach the Ray cluster at {address}" in result.output
    assert not cfg.artifact_root.exists()


def test_a_node_that_does_not_see_the_artifact_root_says_so(tiny_cfg):
    from ppo_core import runs

    cfg = tiny_cfg()
    with pytest.raises(ConfigError, match=rf"node {socket.gethostname()} does not see artifact root {cfg.artifact_root} "
                                          r"\(no .*run.json\): every node of the cluster must mount"):
        runs.check_visible(cfg)
    runs.check_inputs(cfg)
    runs.pin_config(cfg)
    runs.check_visible(cfg)  # once the run is pinned where this node sees it


def test_too_many_training_ranks_are_refused_before_the_flow_starts(tiny_cfg):
    cfg = tiny_cfg(batch_size=6, num_minibatches=2)
    with pytest.raises(ConfigError, match="train_ranks=4 is more than the 3 rollouts of the smallest minibatch"):
        check_execution(2, None, 4, cfg)
    check_execution(2, None, 3, cfg)
