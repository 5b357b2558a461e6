"""Helpers for tests that start real local servers: a free port, waiting for health, finding their processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A loopback port nothing listens on (once the probing socket is closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until ``url``/health answers; fail with the process's output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{proc.args[0]} exited with code {proc.returncode}:\n{output}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"nothing answered on {url} within {timeout:.0f}s")


def processes_mentioning(text: str, where: str = "cmdline") -> list[tuple[int, str]]:
    """(pid, text of /proc/<pid>/<where>) of every process whose ``where`` file ('cmdline' or 'environ') contains ``text``."""
    found = []
    for path in Path("/proc").glob(f"[0-9]*/{where}"):
        try:
            content = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in content:
            found.append((int(path.parent.name), content))
    return found


BIN = Path(sys.executable).parent


def start_prefect_server(home: Path, port: int) -> subprocess.Popen:
    """`prefect server start` with its own PREFECT_HOME (SQLite database), in its own process group."""
    env = {**os.environ, "PREFECT_HOME": str(home)}
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-services"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    wait_healthy(f"http://127.0.0.1:{port}/api", proc)
    return proc


def start_mlflow_server(store: Path, port: int) -> subprocess.Popen:
    """A real `mlflow server` on a SQLite store, one web worker, no job runners, in its own process group."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a server started here with its whole process group (SIGKILL if it does not go within 30 s)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # uvicorn's workers are in the group too; wait until none is left holding the port
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def start_ppo_serve(env: dict[str, str], port: int, *args: str, timeout: float = 300) -> subprocess.Popen:
    """`ppo serve --port PORT ARGS…` with ``env``; returns once it prints ``ready:`` (its output stays readable)."""
    proc = subprocess.Popen(
        [str(BIN / "ppo"), "serve", "--port", str(port), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError("ppo serve exited:\n" + "".join(lines))
        lines.append(line)
        if line.startswith("ready:"):
            # keep reading: the worker's and flow runs' output goes to the same pipe and must never fill it
            proc.lines = lines  # type: ignore[attr-defined]
            threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
            return proc
    proc.kill()
    raise AssertionError("ppo serve never became ready:\n" + "".join(lines))
