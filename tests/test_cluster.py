"""The `ppo` flow on a real two-node Ray cluster (`ray start` head + a second node, token auth, 127.0.0.1).

Shards of the data-parallel phases run on the cluster's workers, training runs
on two mx.distributed ranks as Ray actors, Prefect records every shard task,
and a worker SIGKILLed in the middle of a shard is replaced without changing a
byte of the tables. Every process the test starts is stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from local_servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

RAY = str(Path(sys.executable).with_name("ray"))
TABLES = ("rollouts", "sa_pairs", "rewards", "values", "advantages", "eval", "metrics")


def _ray_pids(marker: str) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()[1:] if marker in line and "ps -eo" not in line]


def _cluster_cpus(address: str, env: dict[str, str]) -> float:
    probe = "import ray; ray.init(address=%r, log_to_driver=False); print(ray.cluster_resources().get('CPU', 0))"
    out = subprocess.run([sys.executable, "-c", probe % address], env=env, capture_output=True, text=True, timeout=120)
    return float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0.0


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head (1 CPU) and a second node (1 CPU) on 127.0.0.1, token auth on; both stopped afterwards."""
    temp = tmp_path_factory.mktemp("ray")
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    env = {**os.environ, **auth}
    common = ["--block", "--num-cpus=1", f"--temp-dir={temp}"]
    nodes: list[subprocess.Popen] = []
    try:
        # a head that exits at once (a port Ray picks for itself was taken meanwhile) is started again on new ports
        for attempt in range(3):
            port = free_port()
            log = temp / f"head-{attempt}.log"
            with open(log, "w") as out:
                head = subprocess.Popen(
                    [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                     f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
                     "--include-dashboard=false", *common],
                    env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            nodes = [head]
            deadline = time.monotonic() + 120
            while not _port_open(port) and head.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if _port_open(port) and head.poll() is None:
                break
        else:
            raise AssertionError("the Ray head did not start:\n" + log.read_text()[-3000:])
        address = f"127.0.0.1:{port}"
        nodes.append(subprocess.Popen(
            [RAY, "start", f"--address={address}", *common],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        while _cluster_cpus(address, env) < 2:
            assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "the second node did not join"
            time.sleep(1)
        yield address, auth
    finally:
        for n in reversed(nodes):
            if n.poll() is None:
                n.terminate()
        for n in reversed(nodes):
            try:
                n.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
        deadline = time.monotonic() + 30
        while _ray_pids(str(temp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _ray_pids(str(temp)):  # what `ray stop` would do, for this cluster only
            os.kill(pid, signal.SIGKILL)
        assert _ray_pids(str(temp)) == [], "Ray processes were left behind"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _overrides(tiny_model_dir: Path, root: Path) -> dict:
    return {
        "model": str(tiny_model_dir), "artifact_root": str(root), "batch_size": 8, "max_new_tokens": 8,
        "score_batch_size": 4, "ppo_epochs": 2, "num_minibatches": 2, "eval_size": 4, "eval_max_new_tokens": 6,
        "lora_layers": 1,
    }


def _run_flow(address: str, auth: dict, monkeypatch, overrides: dict):
    from flows.ppo import ppo

    for k, v in auth.items():
        monkeypatch.setenv(k, v)
    state = ppo(run="cluster", iterations=1, overrides=overrides, workers=2, ray_address=address, train_ranks=2,
                return_state=True)
    assert state.is_completed(), state
    return state


def _digests(cfg) -> dict[str, str]:
    return {
        f"{it}/{t}": hashlib.sha256(cfg.layout.table(it, t).read_bytes()).hexdigest()
        for it in (0, 1) for t in TABLES if cfg.layout.table(it, t).is_file()
    }


@pytest.fixture(scope="module")
def first_run(ray_cluster, tiny_model_dir, tmp_path_factory):
    from ppo_core.config import load_config

    address, auth = ray_cluster
    with pytest.MonkeyPatch.context() as mp:
        overrides = _overrides(tiny_model_dir, tmp_path_factory.mktemp("cluster-run"))
        state = _run_flow(address, auth, mp, overrides)
    return load_config(overrides={**overrides, "run": "cluster"}), state


def test_shards_run_on_the_cluster_workers_and_the_tables_are_whole(first_run):
    cfg, state = first_run
    layout = cfg.layout
    ro = pl.read_parquet(layout.table(1, "rollouts"))
    n_tokens = int(ro["response_token_ids"].list.len().sum())
    assert ro["rollout_id"].to_list() == list(range(cfg.batch_size))
    for table in ("sa_pairs", "rewards", "values", "advantages"):
        df = pl.read_parquet(layout.table(1, table))
        assert df.height == n_tokens and df.select("rollout_id", "t").is_duplicated().sum() == 0, table
    assert pl.read_parquet(layout.table(1, "eval")).height == cfg.eval_size
    assert layout.checkpoint(1).adapter("policy").is_file() and layout.manifest(1).is_file()
    # the shards ran in at least two worker processes, none of them the flow's own
    ran_on = {
        p.stem: json.loads(p.read_text())["ran_on"]["pid"] for p in layout.phase_record(1, "rollout").parent.glob("*.json")
    }
    shard_pids = {pid for name, pid in ran_on.items() if ".part-" in name}
    assert len(shard_pids) >= 2 and os.getpid() not in shard_pids, ran_on
    assert ran_on["reward"] == os.getpid()  # whole phases run in the flow's process
    assert sorted(n for n in ran_on if n.startswith("rollout.")) == ["rollout.part-0-of-2", "rollout.part-1-of-2"]


def test_every_shard_is_a_prefect_task_run(first_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _, state = first_run
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    names = {r.name: r.state.type.value for r in runs}
    for phase in ("rollout", "attribute", "value", "evaluate"):
        for part in (0, 1):
            assert names.get(f"{phase}-1-part-{part}-of-2") == "COMPLETED", sorted(names)
        assert names.get(f"merge-{phase}-1") == "COMPLETED"
    assert names.get("train-1") == "COMPLETED" and names.get("evaluate-0-part-0-of-2") == "COMPLETED"


def test_a_worker_killed_mid_shard_is_replaced_and_the_tables_are_unchanged(first_run, ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    cfg, _ = first_run
    address, auth = ray_cluster
    pause = tmp_path / "paused.pid"
    monkeypatch.setenv("PPO_PAUSE_AT", "generate.step")  # the first shard to sample waits there, to be killed
    monkeypatch.setenv("PPO_PAUSE_FILE", str(pause))
    killed: list[int] = []

    def kill_when_paused():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if pause.is_file() and pause.read_text().strip():
                pid = int(pause.read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_when_paused, daemon=True)
    killer.start()
    overrides = _overrides(tiny_model_dir, tmp_path / "artifacts")
    _run_flow(address, auth, monkeypatch, overrides)
    killer.join(timeout=5)
    assert killed and killed[0] != os.getpid(), "no shard paused to be killed"
    from ppo_core.config import load_config

    again = load_config(overrides={**overrides, "run": "cluster"})
    assert _digests(again) == _digests(cfg)  # the retried shard wrote what the first run's did


def test_a_training_rank_killed_on_the_cluster_fails_the_flow_and_a_rerun_resumes(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    from ppo_core.config import load_config

    address, auth = ray_cluster
    overrides = _overrides(tiny_model_dir, tmp_path / "artifacts")
    cfg = load_config(overrides={**overrides, "run": "cluster"})
    monkeypatch.setenv("PPO_KILL_AT", "train.step:2")  # passed to the workers and rank actors
    monkeypatch.setenv("PPO_KILL_RANK", "1")
    from flows.ppo import ppo

    for k, v in auth.items():
        monkeypatch.setenv(k, v)
    state = ppo(run="cluster", iterations=1, overrides=overrides, workers=2, ray_address=address, train_ranks=2,
                return_state=True)
    assert state.is_failed()
    # the killed rank, or its peer whose collective lost the connection first
    assert re.search(r"training rank [01] of 2 failed", str(state.message) + repr(state)), state
    assert not cfg.layout.checkpoint(1).dir.exists() and cfg.layout.table(1, "advantages").is_file()
    monkeypatch.delenv("PPO_KILL_AT")
    _run_flow(address, auth, monkeypatch, overrides)
    assert cfg.layout.completed_iterations() == [0, 1]
    record = json.loads(cfg.layout.phase_record(1, "advantage").read_text())
    assert record["ran_on"]["pid"] == os.getpid()  # written by the failed flow run, reused by the second
