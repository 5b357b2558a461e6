"""`prefect deployment run ppo/iterate` against a real Prefect server and process worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_core import track
from local_servers import free_port, processes_mentioning, start_ppo_serve
from ppo_core.config import PROJECT_ROOT, PPOConfig

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _procs_with_env(marker: str) -> list[int]:
    return [pid for pid, _ in processes_mentioning(marker, "environ") if pid != os.getpid()]


@pytest.fixture
def served(tmp_path, tmp_path_factory):
    port = free_port()
    home = tmp_path / "prefect-home"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    # the worker's allowed roots: the tests' temporary folders (tiny model, artifact roots) and the shipped data
    env["PPO_ALLOWED_ROOTS"] = os.pathsep.join([str(tmp_path_factory.getbasetemp()), str(PROJECT_ROOT / "data")])
    env.pop("PPO_KILL_AT", None)
    proc = start_ppo_serve(env, port, "--ray-workers", "2")
    yield env
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while _procs_with_env(str(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _procs_with_env(str(home)) == [], "ppo serve left processes behind"


def _deployment_run(env: dict, params: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", "ppo/iterate", "--params", json.dumps(params), "--watch",
         "--watch-timeout", "600"],
        env=env, capture_output=True, text=True, timeout=700,
    )


def test_deployment_iterates_and_resumes(served, tiny_cfg):
    cfg = tiny_cfg(run="deployed")
    overrides = {k: cfg.to_json_dict()[k] for k in ("model", "artifact_root", "batch_size", "max_new_tokens",
                                                    "score_batch_size", "ppo_epochs", "num_minibatches",
                                                    "eval_size", "eval_max_new_tokens", "lora_layers")}
    first = _deployment_run(served, {"run": "deployed", "iterations": 1, "overrides": overrides})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert cfg.layout.completed_iterations() == [0, 1]
    records = {p: p.stat().st_mtime_ns for p in cfg.layout.phase_record(1, "rollout").parent.glob("*.json")}
    assert len(records) == 7

    # the next iteration on two Ray workers (a local Ray the flow run starts and stops): `-p workers=2`
    second = _deployment_run(served, {"run": "deployed", "iterations": 1, "overrides": overrides, "workers": 2})
    assert second.returncode == 0, _last_flow_run_message(served) + second.stdout[-3000:] + second.stderr[-3000:]
    assert cfg.layout.completed_iterations() == [0, 1, 2]
    assert all(p.stat().st_mtime_ns == t for p, t in records.items()), "iteration 1 was recomputed"
    assert cfg.layout.phase_record(2, "rollout.part-1-of-2").is_file()  # iteration 2 ran sharded

    # and one on the Ray head `ppo serve --ray-workers 2` started: `-p workers=2 -p ray_address=auto`
    third = _deployment_run(served, {"run": "deployed", "iterations": 1, "overrides": overrides, "workers": 2,
                                     "ray_address": "auto"})
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert cfg.layout.completed_iterations() == [0, 1, 2, 3]
    shard_pids = {json.loads(cfg.layout.phase_record(3, f"rollout.part-{i}-of-2").read_text())["ran_on"]["pid"] for i in (0, 1)}
    assert len(shard_pids) == 2
    history = track.run_metrics(PPOConfig(**cfg.to_json_dict()))
    assert [s for s, _ in history["reward/score"]] == [1, 2, 3]

    # a bad parameter fails the flow run with the reason, before anything is written
    bad = _deployment_run(served, {"run": "../escape", "iterations": 1, "overrides": overrides})
    assert bad.returncode != 0
    assert "Failed" in bad.stdout + bad.stderr
    assert not (Path(overrides["artifact_root"]) / "run=../escape").exists()
    assert sorted(p.name for p in Path(overrides["artifact_root"]).glob("run=*")) == ["run=deployed"]

    # a path outside the worker's allowed roots is refused, naming the parameter, before anything is read
    passwd = _deployment_run(served, {"run": "peek", "iterations": 1, "overrides": {**overrides, "eval_prompts_path": "/etc/passwd"}})
    assert passwd.returncode != 0
    assert "'eval_prompts_path' = /etc/passwd" in _last_flow_run_message(served), passwd.stdout[-2000:]
    assert not (Path(overrides["artifact_root"]) / "run=peek").exists()

    # nor can job variables loosen that or run a command: the pool's template does not take them
    marker = Path(overrides["artifact_root"]).parent / "pwned"
    sneaky = subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", "ppo/iterate", "--params",
         json.dumps({"run": "peek2", "iterations": 1, "overrides": {**overrides, "eval_prompts_path": "/etc/passwd"}}),
         "--job-variable", 'env={"PPO_ALLOWED_ROOTS": "/"}', "--job-variable", f"command=touch {marker}",
         "--watch", "--watch-timeout", "600"],
        env=served, capture_output=True, text=True, timeout=700,
    )
    assert sneaky.returncode != 0 and not marker.exists()
    assert "'eval_prompts_path' = /etc/passwd" in _last_flow_run_message(served), sneaky.stdout[-2000:] + sneaky.stderr[-2000:]


def _last_flow_run_message(env: dict) -> str:
    """The newest flow run's final state message (what the Prefect UI shows), read through the API."""
    code = ("import asyncio\nfrom prefect.client.orchestration import get_client\n"
            "from prefect.client.schemas.sorting import FlowRunSort\n"
            "async def main():\n    async with get_client() as c:\n"
            "        [r] = await c.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)\n"
            "        print(r.state.message)\nasyncio.run(main())\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout


def _request(url: str, method: str = "GET", headers: dict | None = None, data: bytes | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_served_api_refuses_foreign_hosts_origins_and_requests_without_csrf(served):
    """DNS rebinding (a foreign Host), a cross-site page (a foreign Origin) and a token-less POST never reach Prefect."""
    api = served["PREFECT_API_URL"]
    port = api.rsplit(":", 1)[1].split("/")[0]
    assert _request(f"{api}/health")[0] == 200
    status, body = _request(f"{api}/health", headers={"Host": f"evil.example:{port}"})
    assert status == 403 and "evil.example" in body
    json_post = {"Content-Type": "application/json"}
    status, body = _request(f"{api}/flows/filter", "POST", {**json_post, "Origin": "http://evil.example"}, b"{}")
    assert status == 403 and "cross-origin" in body
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    assert _request(f"{api}/flows/filter", "OPTIONS", preflight)[0] == 403
    status, body = _request(f"{api}/flows/filter", "POST", json_post, b"{}")
    assert status == 403 and "csrf" in body.lower()
    # the CLI (and the worker) still work: they fetch a CSRF token and send no Origin
    listed = subprocess.run([str(BIN / "prefect"), "deployment", "ls"], env=served, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "iterate" in listed.stdout, listed.stderr
