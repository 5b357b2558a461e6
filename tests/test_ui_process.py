"""`ppo ui` is one quiet MLflow web server that stops with it, however it is stopped."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def test_ppo_ui_is_one_quiet_web_worker_that_stops_with_it(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("ppo")), "ui", "--root", str(tmp_path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the MLflow UI did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        servers = [p for p in _processes_mentioning(f"--port {port}") if " ui --root " not in p]
        assert len(servers) == 2, servers  # `mlflow ui` and its one uvicorn worker
        assert not _processes_mentioning("huey_consumer")  # no GenAI job runners
    finally:
        proc.send_signal(signal.SIGTERM)  # `ppo ui` only, not its process group
        output, _ = proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while _processes_mentioning(f"--port {port}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_mentioning(f"--port {port}"), "the web worker outlived `ppo ui`"
    assert "Warning" not in output, output
