"""`ppo ui` is one quiet MLflow web server that stops with it, however it is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from local_servers import free_port, processes_mentioning, wait_healthy


def test_ppo_ui_is_one_quiet_web_worker_that_stops_with_it(tmp_path):
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("ppo")), "ui", "--root", str(tmp_path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=120)
        servers = [cmd for _, cmd in processes_mentioning(f"--port {port}") if " ui --root " not in cmd]
        assert len(servers) == 2, servers  # `mlflow ui` and its one uvicorn worker
        assert not processes_mentioning("huey_consumer")  # no GenAI job runners
    finally:
        proc.send_signal(signal.SIGTERM)  # `ppo ui` only, not its process group
        output, _ = proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while processes_mentioning(f"--port {port}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(f"--port {port}"), "the web worker outlived `ppo ui`"
    assert "Warning" not in output, output
