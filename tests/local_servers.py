"""Helpers for tests that start real local servers: a free port, waiting for health, finding their processes."""

from __future__ import annotations

import socket
import subprocess
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
