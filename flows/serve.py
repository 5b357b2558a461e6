"""`ppo serve`: a local Prefect server, the `ppo-process` pool, the `iterate` deployment and a worker.

With ``ray_workers`` > 0 it also starts a local Ray head with that many worker
processes (token authentication on, a fresh token unless RAY_AUTH_TOKEN is
set) and hands its address and token to the Prefect worker, so deployment runs
with ``-p workers=N -p ray_address=auto`` shard their phases on it.
Everything binds 127.0.0.1 unless asked otherwise, and everything started here
is stopped on Ctrl-C (or SIGTERM).

The Prefect API runs code as the worker for whoever reaches it, so the server
is Prefect's app behind ``flows.prefect_app``'s host/origin guard, with CORS
limited to its own origin and CSRF protection on. A host other than loopback
is refused unless ``PREFECT_SERVER_API_AUTH_STRING`` is set (every request
then needs it; the worker is handed it as ``PREFECT_API_AUTH_STRING``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ppo_core.config import PROJECT_ROOT
from tasks.prefect_env import apply_defaults

POOL = "ppo-process"
AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"


class ServeError(RuntimeError):
    """`ppo serve` refuses to start as asked; the message says why and what to do."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host`` (0.0.0.0 is not one)."""
    return "127.0.0.1" if host == "0.0.0.0" else host


def origins(hosts: list[str]) -> str:
    """The browser origins of ``hosts`` (Host header values), comma-separated."""
    return ",".join(f"http://{h}" for h in hosts)


def allowed_hosts(host: str, port: int) -> list[str]:
    """Host headers the server answers: its loopback names, and for another bind address this machine's names."""
    names = {"127.0.0.1", "localhost", host}
    if not is_loopback(host):
        names |= {socket.gethostname(), socket.getfqdn()}
        try:
            names |= set(socket.gethostbyname_ex(socket.gethostname())[2])
        except OSError:
            pass
        names |= {h.strip() for h in os.environ.get("PPO_SERVE_EXTRA_HOSTS", "").split(",") if h.strip()}
    names.discard("0.0.0.0")
    bracketed = {f"[{n}]" if ":" in n else n for n in names}  # an IPv6 literal in a Host header
    hosts = {f"{n}:{port}" for n in bracketed} | ({n for n in bracketed} if port == 80 else set())
    return sorted(hosts)


def server_env(host: str, port: int, env: dict[str, str]) -> dict[str, str]:
    """The server's settings: the guard's lists, CORS to its own origins, CSRF on, the UI's API address."""
    hosts = allowed_hosts(host, port)
    return {
        **env,
        "PPO_SERVE_ALLOWED_HOSTS": ",".join(hosts),
        "PPO_SERVE_ALLOWED_ORIGINS": origins(hosts),
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": origins(hosts),
        "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        # what the UI in a browser calls; on a shared host set it to the name people reach it by
        "PREFECT_UI_API_URL": env.get("PREFECT_UI_API_URL") or f"http://{reachable_host(host)}:{port}/api",
        # deployment concurrency leases in files under PREFECT_HOME, not in the server's memory: a restarted
        # server knows the leases of the flow runs still running, which go on renewing them
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": env.get("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE")
        or "prefect.server.concurrency.lease_storage.filesystem",
    }


# Inherited settings that would widen the MLflow server's host and origin checks or turn them off
MLFLOW_WEAKENING = (
    "MLFLOW_SERVER_ALLOWED_HOSTS", "MLFLOW_SERVER_CORS_ALLOWED_ORIGINS",
    "MLFLOW_SERVER_DISABLE_SECURITY_MIDDLEWARE", "MLFLOW_SERVER_X_FRAME_OPTIONS",
)


def mlflow_ui_command(cfg, host: str, port: int, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """`mlflow ui` on the run store with explicit host/origin lists, and an environment that cannot loosen them."""
    from ppo_core.track import tracking_uri

    hosts = allowed_hosts(host, port)
    command = [
        sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(cfg), "--host", host, "--port", str(port),
        "--allowed-hosts", ",".join(hosts), "--cors-allowed-origins", origins(hosts),
        "--x-frame-options", "SAMEORIGIN",
        "--workers", "1",  # one person looks at it: one web worker process, not MLflow's default of 4
    ]  # fmt: skip
    quiet = {
        # MLflow's job runner (GenAI online scoring, trace archival) starts ~9 huey processes; PPO runs use none
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        # the server's own imports warn about Starlette's deprecated WSGI middleware on every start
        "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore:starlette.middleware.wsgi is deprecated",
    }
    return command, {**{k: v for k, v in env.items() if k not in MLFLOW_WEAKENING}, **quiet}


# Job variables a flow run may not set: the command the worker executes, its environment (which holds
# PPO_ALLOWED_ROOTS and the credentials) and its working directory
LOCKED_JOB_VARIABLES = ("command", "env", "working_dir")


def locked_job_template(env: dict[str, str]) -> dict:
    """Prefect's process-pool template without the job variables that would let a caller run code as the worker."""
    out = subprocess.run(
        [_bin("prefect"), "work-pool", "get-default-base-job-template", "--type", "process"],
        env=env, capture_output=True, text=True, check=True,
    )
    template = json.loads(out.stdout)
    for name in LOCKED_JOB_VARIABLES:
        template["variables"]["properties"].pop(name, None)
        # absent, not empty: Prefect deep-merges a flow run's `env` into any dict it finds here
        template["job_configuration"].pop(name, None)
    template["variables"]["required"] = [r for r in template["variables"].get("required", []) if r not in LOCKED_JOB_VARIABLES]
    return template


def check_host(host: str, env: dict[str, str], log=print) -> None:
    """Loopback by default; anything else only with an auth string, and never silently."""
    if is_loopback(host):
        return
    if not env.get(AUTH_ENV):
        raise ServeError(
            f"refusing to serve the Prefect API on {host}: anyone who reaches it can run code as the worker. "
            f"Set {AUTH_ENV}=<user>:<password> (clients then need PREFECT_API_AUTH_STRING) or keep --host 127.0.0.1"
        )
    log(f"WARNING: the Prefect API listens on {host}, beyond this machine; it is protected only by "
        f"{AUTH_ENV} (use TLS in front of it on an untrusted network)")


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
            # `ray start --block` cleans up its node on SIGTERM; Prefect's processes on SIGINT
            p.send_signal(signal.SIGTERM if "ray" in Path(p.args[0]).name else signal.SIGINT)
    for p in reversed(procs):
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # each child leads its own session: its whole group goes
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ray_head(workers: int, env: dict[str, str], procs: list[subprocess.Popen], timeout: float) -> dict[str, str]:
    """A local Ray head with ``workers`` CPUs; returns what a Ray client needs in its environment."""
    port = _free_port()
    client_env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": env.get("RAY_AUTH_TOKEN") or secrets.token_hex(32),
        "RAY_ADDRESS": f"127.0.0.1:{port}",
    }
    head = subprocess.Popen(
        [_bin("ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--num-cpus={workers}", "--include-dashboard=false", f"--dashboard-port={_free_port()}",
         f"--ray-client-server-port={_free_port()}", f"--temp-dir={tempfile.mkdtemp(prefix='ppo-ray-')}"],
        env={**env, **client_env, "RAY_USAGE_STATS_ENABLED": "0"}, start_new_session=True,
    )  # fmt: skip
    procs.append(head)
    deadline = time.monotonic() + timeout
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"the Ray head exited with code {head.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return client_env
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray head did not listen on 127.0.0.1:{port} within {timeout:.0f}s")
        time.sleep(0.5)


WATCH_EVERY = 5.0  # seconds between looks at which flow runs the supervised worker's processes run
RESTARTS, RESTART_WINDOW = 5, 600.0
WORKER_MARK = "PPO_SERVE_WORKER"  # in the worker's environment, so in every flow-run process it starts


@dataclass
class Supervised:
    """A child `ppo serve` keeps running: started by ``start``, restarted when it dies (within a budget)."""

    name: str
    start: Callable[[], subprocess.Popen]
    restartable: bool = True
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    def may_restart(self, now: float) -> bool:
        """Crash-loop guard: at most RESTARTS restarts within RESTART_WINDOW seconds."""
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
        return self.restartable and len(self.restarts) <= RESTARTS


def flow_run_processes(mark: str) -> dict[str, int]:
    """{flow run id: pid} of this machine's processes that carry ``mark`` (started by our worker) and a flow run."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if mark.encode() not in entries:
            continue
        for entry in entries:
            if entry.startswith(b"PREFECT__FLOW_RUN_ID="):
                found.setdefault(entry.split(b"=", 1)[1].decode(), int(environ.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped, as in some containers whose init does not, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def crash_orphans(env: dict[str, str], orphans: dict[str, int], log=print) -> list[str]:
    """Mark CRASHED the flow runs in ``orphans`` ({id: pid}, processes our dead worker started, now gone) that
    Prefect still shows unfinished; returns their names.

    A process worker reports a flow run whose process dies. When the worker
    dies with it (a container or machine kill), nobody does: the flow run stays
    RUNNING and holds the deployment's one concurrency slot until its lease
    expires (minutes), so the next deployment run waits. Marking it CRASHED
    frees the slot at once; the next flow run of the PPO run resumes it.
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    from tasks.flow_runs import record_final

    marked = []
    settings = {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env.get("PREFECT_API_AUTH_STRING")}
    with temporary_settings(updates=settings), get_client(sync_client=True) as client:
        for run_id, pid in orphans.items():
            message = f"its process (pid {pid}) is gone: the worker that started it died with it; marked by ppo serve"
            if (run := record_final(client, run_id, Crashed(message=message))) is not None:
                log(f"marked flow run {run.name} CRASHED: {message}")
                marked.append(run.name)
    return marked


def serve(
    host: str = "127.0.0.1", port: int = 4200, ray_workers: int = 0, startup_timeout: float = 180.0, log=print
) -> int:
    """Start server, pool, deployment, worker (and a Ray head); block until interrupted; stop them all.

    A server or worker that dies is started again (same port, same database
    under PREFECT_HOME), at most ``RESTARTS`` times in ``RESTART_WINDOW``
    seconds. The flow runs whose processes died with the worker are marked
    CRASHED; the next flow run of their PPO run resumes from the finished phases.
    """
    client_host = reachable_host(host)
    api_url = f"http://{client_host}:{port}/api"
    env = apply_defaults({**os.environ, "PREFECT_API_URL": api_url})
    try:
        check_host(host, env, log)
    except ServeError as exc:
        log(f"error: {exc}")
        return 2
    if env.get(AUTH_ENV):
        env["PREFECT_API_AUTH_STRING"] = env[AUTH_ENV]  # the worker and the CLI calls below authenticate
    started: list[subprocess.Popen] = []  # every process started here, stopped at the end whatever happened
    children: list[Supervised] = []
    stop = {"now": False}

    def on_signal(signum, frame):  # noqa: ARG001
        stop["now"] = True

    def start_server() -> subprocess.Popen:
        # own process groups: a terminal's Ctrl-C reaches only us, and we stop the children in order
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "flows.prefect_app:create_app", "--host", host,
             "--port", str(port), "--log-level", "warning"],
            env=server_env(host, port, env), cwd=PROJECT_ROOT, start_new_session=True,
        )  # fmt: skip
        started.append(server)
        _wait_healthy(api_url, server, startup_timeout)
        return server

    def start_worker() -> subprocess.Popen:
        worker = subprocess.Popen(
            [_bin("prefect"), "worker", "start", "--pool", POOL], env=worker_env, cwd=PROJECT_ROOT, start_new_session=True
        )
        started.append(worker)
        return worker

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        log(f"starting Prefect server on {api_url} ...")
        children.append(Supervised("Prefect server", start_server))
        children[-1].proc = start_server()
        pools = subprocess.run([_bin("prefect"), "work-pool", "ls"], env=env, capture_output=True, text=True, check=True)
        verb = ["update", POOL] if POOL in pools.stdout else ["create", POOL, "--type", "process"]
        with tempfile.TemporaryDirectory() as tmp:
            template = Path(tmp) / "job-template.json"
            template.write_text(json.dumps(locked_job_template(env)))
            subprocess.run([_bin("prefect"), "work-pool", *verb, "--base-job-template", str(template)], env=env, check=True, capture_output=True)
        subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=PROJECT_ROOT, check=True, capture_output=True)
        mark = f"{WORKER_MARK}={os.getpid()}-{secrets.token_hex(4)}"
        worker_env = {**env, WORKER_MARK: mark.split("=", 1)[1]}
        if ray_workers:
            log(f"starting a local Ray head with {ray_workers} worker processes ...")
            worker_env.update(_start_ray_head(ray_workers, env, started, startup_timeout))
            # a new head would have a new address and token, unknown to running flow runs: not restarted
            children.append(Supervised("Ray head", lambda: started[-1], restartable=False, proc=started[-1]))
        children.append(Supervised("Prefect worker", start_worker))
        children[-1].proc = start_worker()
        log(f"ready: deployment 'ppo/iterate' on pool '{POOL}'. UI: http://{client_host}:{port}")
        log(f"  PREFECT_API_URL={api_url} prefect deployment run ppo/iterate -p run=<name> -p iterations=N")
        if ray_workers:
            log(f"  Ray head on {worker_env['RAY_ADDRESS']}: add -p workers={ray_workers} -p ray_address=auto")
        # flow runs our worker's processes run: {id: (pid, the worker process that started it)}
        watched: dict[str, tuple[int, subprocess.Popen]] = {}
        worker = children[-1]
        next_watch = 0.0
        while not stop["now"]:
            time.sleep(0.5)
            if time.monotonic() > next_watch and Path("/proc").is_dir():
                next_watch = time.monotonic() + WATCH_EVERY
                gone = {k: v for k, v in watched.items() if not _alive(v[0])}
                watched = {k: v for k, v in watched.items() if k not in gone}
                for run_id, pid in flow_run_processes(mark).items():
                    watched.setdefault(run_id, (pid, worker.proc))
                # a live worker reports its own flow runs' deaths; a dead one cannot
                orphans = {k: pid for k, (pid, started_by) in gone.items() if started_by.poll() is not None}
                if orphans:
                    try:
                        crash_orphans(env, orphans, log)
                    except Exception as exc:  # the server restarting too: the next run's lock check records them
                        log(f"could not mark the flow runs that died with the worker: {exc}")
            for child in children:
                if stop["now"] or child.proc.poll() is None:
                    continue
                code = child.proc.returncode
                if not child.may_restart(time.monotonic()):
                    log(f"the {child.name} exited with code {code} (restarted {len(child.restarts) - 1} times "
                        f"in {RESTART_WINDOW:.0f}s); stopping")
                    return 1
                log(f"the {child.name} exited with code {code}; starting it again")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)  # what is left of its process group
                try:
                    child.proc = child.start()
                except (RuntimeError, TimeoutError) as exc:
                    log(f"the {child.name} could not be started again ({exc}); stopping")
                    return 1
                log(f"the {child.name} is back")
                next_watch = 0.0  # look for the flow runs that died with it now
        return 0
    finally:
        log("stopping worker, Ray and server ..." if ray_workers else "stopping worker and server ...")
        _stop(sorted(started, key=lambda p: "worker" in p.args))  # workers stop first (_stop goes backwards)
        for s, h in old.items():
            signal.signal(s, h)
