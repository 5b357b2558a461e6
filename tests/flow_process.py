"""The `ppo` flow in a child process (to be killed, paused or cut off from its servers), and what it leaves behind."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

FLOW = (
    "import json, sys; from flows.ppo import ppo; "
    "ppo(run=sys.argv[1], until=int(sys.argv[2]), overrides=json.loads(sys.argv[3]))"
)
# what a test sets for one child only; never inherited from the test process
CHILD_ONLY = ("PPO_KILL", "PPO_PAUSE", "PPO_FAULT_TRACE", "MLFLOW_TRACKING_URI", "PREFECT_API_URL")


def tiny_overrides(model_dir: Path, root: Path) -> dict:
    """The tests' small run on the tiny model (2 layers: lora_layers=1 keeps one frozen trunk layer), as JSON."""
    return {
        "model": str(model_dir), "artifact_root": str(root), "batch_size": 6, "max_new_tokens": 8,
        "score_batch_size": 4, "ppo_epochs": 2, "num_minibatches": 2, "eval_size": 4,
        "eval_max_new_tokens": 6, "lora_layers": 1,
    }


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CHILD_ONLY)}
    env.update(extra)
    return env


def start_flow(run: str, until: int, overrides: dict, log: Path, **env: str) -> subprocess.Popen:
    """The flow in its own process group (a kill of that group leaves pytest alone), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", FLOW, run, str(until), json.dumps(overrides)], env=child_env(**env),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


def run_flow(run: str, until: int, overrides: dict, log: Path, **env: str) -> int:
    """Run the flow to its end (or its kill); any exit but success or SIGKILL fails with the output."""
    proc = start_flow(run, until, overrides, log, **env)
    rc = proc.wait(timeout=900)
    if rc not in (0, -signal.SIGKILL):
        raise AssertionError(f"flow process exited with {rc}:\n" + log.read_text()[-4000:])
    return rc


def wait_paused(pause_file: Path, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Wait until the flow process reaches its pause point (it writes its pid into ``pause_file``)."""
    deadline = time.monotonic() + timeout
    while not (pause_file.is_file() and pause_file.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"the flow exited ({proc.returncode}) before its pause point:\n" + log.read_text()[-4000:])
        if time.monotonic() > deadline:
            raise AssertionError(f"the flow never reached its pause point:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def release(pause_file: Path) -> None:
    pause_file.write_text("release")


def digest(run_dir: Path) -> dict[str, str]:
    """sha256 of every table and adapter under a final name."""
    files = sorted(p for p in run_dir.rglob("*") if p.suffix in (".parquet", ".safetensors") and not p.name.startswith("."))
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def mlflow_state(run: str, root: Path, tracking_uri: str | None = None) -> dict:
    """Metric histories (time/* by step only: wall times differ between runs), versions, status and params count."""
    from ppo_core import registry, track
    from ppo_core.config import PPOConfig
    from ppo_core.registry import env_override

    cfg = PPOConfig(run=run, artifact_root=root)
    with env_override(**({"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {})):
        mlf = track.client(cfg)
        mlflow_run = mlf.get_run(track.ensure_run(cfg))
        histories = {}
        for key in mlflow_run.data.metrics:
            points = sorted((m.step, m.value) for m in mlf.get_metric_history(mlflow_run.info.run_id, key))
            histories[key] = [s for s, _ in points] if key.startswith("time/") else points
        versions = [(v.tags.get("iteration"), v.tags.get("adapter_sha256"), bool(v.description))
                    for v in mlf.search_model_versions(f"name='{registry.registered_model_name(cfg)}'")]
    return {"metrics": histories, "versions": versions, "status": mlflow_run.info.status, "params": len(mlflow_run.data.params)}


def flow_runs(api: str) -> list[dict]:
    """Every flow run the Prefect server at ``api`` knows, oldest first, as JSON (through Prefect's own client,
    which also passes a server's CSRF protection)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
    return sorted((r.model_dump(mode="json") for r in runs), key=lambda r: r["created"])


def unfinished_flow_runs(api: str) -> list[dict]:
    """Flow runs the Prefect server at ``api`` still shows as scheduled, pending or running."""
    return [r for r in flow_runs(api) if r["state_type"] in ("RUNNING", "PENDING", "SCHEDULED")]


def kill_point_kind(label: str) -> str:
    """What a fail point interrupts: a phase, a manifest, MLflow logging, the registration, the report."""
    scope_parts = label.split("/")
    return scope_parts[1] if scope_parts[0].startswith("iter=") else scope_parts[0]


def draw_kill_points(trace: list[str], count: int, seed: int) -> list[str]:
    """``count`` distinct labels of ``trace``: one of every kind first, the rest uniformly; in trace order."""
    rng = random.Random(seed)
    by_kind: dict[str, list[str]] = defaultdict(list)
    for label in trace:
        by_kind[kill_point_kind(label)].append(label)
    chosen = {rng.choice(labels) for labels in by_kind.values()}
    rest = [label for label in trace if label not in chosen]
    chosen |= set(rng.sample(rest, max(0, min(count - len(chosen), len(rest)))))
    return [label for label in trace if label in chosen]
