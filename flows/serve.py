"""`ppo serve`: a local Prefect server, the `ppo-process` pool, the `iterate` deployment and a worker.

Everything binds 127.0.0.1 unless asked otherwise, and everything started here
is stopped on Ctrl-C (or SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ppo_core.config import PROJECT_ROOT
from tasks.prefect_env import apply_defaults

POOL = "ppo-process"


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _wait_healthy(api_url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Prefect server did not answer on {api_url} within {timeout:.0f}s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in reversed(procs):
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve(host: str = "127.0.0.1", port: int = 4200, startup_timeout: float = 180.0, log=print) -> int:
    """Start server, pool, deployment and worker; block until interrupted; stop them all."""
    api_url = f"http://{host}:{port}/api"
    env = apply_defaults({**os.environ, "PREFECT_API_URL": api_url})
    procs: list[subprocess.Popen] = []
    stop = {"now": False}

    def on_signal(signum, frame):  # noqa: ARG001
        stop["now"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        log(f"starting Prefect server on {api_url} ...")
        # own process groups: a terminal's Ctrl-C reaches only us, and we stop the children in order
        server = subprocess.Popen(
            [_bin("prefect"), "server", "start", "--host", host, "--port", str(port)], env=env, start_new_session=True
        )
        procs.append(server)
        _wait_healthy(api_url, server, startup_timeout)
        pools = subprocess.run([_bin("prefect"), "work-pool", "ls"], env=env, capture_output=True, text=True, check=True)
        if POOL not in pools.stdout:
            subprocess.run([_bin("prefect"), "work-pool", "create", POOL, "--type", "process"], env=env, check=True, capture_output=True)
        subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=PROJECT_ROOT, check=True, capture_output=True)
        worker = subprocess.Popen(
            [_bin("prefect"), "worker", "start", "--pool", POOL], env=env, cwd=PROJECT_ROOT, start_new_session=True
        )
        procs.append(worker)
        log(f"ready: deployment 'ppo/iterate' on pool '{POOL}'. UI: http://{host}:{port}")
        log(f"  PREFECT_API_URL={api_url} prefect deployment run ppo/iterate -p run=<name> -p iterations=N")
        while not stop["now"] and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        dead = [p for p in procs if p.poll() is not None]
        if dead and not stop["now"]:
            log(f"a child process exited unexpectedly ({dead[0].args[1:3]}); stopping")
            return 1
        return 0
    finally:
        log("stopping worker and server ...")
        _stop(procs)
        for s, h in old.items():
            signal.signal(s, h)
