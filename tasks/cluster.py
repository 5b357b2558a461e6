"""Where a flow's tasks run: in the flow's process, or on a Ray cluster (local or existing).

``execution(workers, ray_address, train_ranks)`` yields the pipeline's runner:

- no workers, no address: every phase in the flow's process (the default);
  ``train_ranks`` > 1 trains on that many local processes.
- ``workers`` = N without an address (or ``ray_address="local"``): a local Ray
  instance with N worker processes, started here and stopped at the end.
- an address (``auto``, ``host:port``, ``ray://host:10001``): an existing
  cluster, which keeps running; ``workers`` defaults to its CPU count.

With Ray, the data-parallel phases run as N shards, one Prefect task each, on
the workers (retried on another worker when one dies), and training ranks run
as Ray actors spread over the nodes. Each worker uses one BLAS thread: N
single-threaded workers beat one N-threaded process here (MLX's element-wise
CPU kernels are single-threaded).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ppo_core.config import ConfigError, PPOConfig
from ppo_core.phases import TrainJob
from ppo_core.train import TrainingError
from tasks.phases import PrefectRunner

WORKER_ENV = {"PPO_BLAS_THREADS": "1"}
# fault points and rank deadlines of the driver's environment reach the workers too
PASSED_TO_WORKERS = ("PPO_KILL_AT", "PPO_KILL_RANK", "PPO_PAUSE_AT", "PPO_PAUSE_FILE", "PPO_RANK_TIMEOUT", "PPO_FAULT_TRACE")
SHARD_RETRIES = 3  # Ray re-runs a shard whose worker died (not one that raised)


def worker_env() -> dict[str, str]:
    return {**WORKER_ENV, **{k: os.environ[k] for k in PASSED_TO_WORKERS if k in os.environ}}


def check_execution(workers: int, ray_address: str | None, train_ranks: int, cfg: PPOConfig | None = None) -> None:
    """Parameter errors, before anything starts (with ``cfg``: also more ranks than its minibatches allow)."""
    if workers < 0:
        raise ConfigError(f"parameter 'workers' must be >= 0 (got {workers})")
    if train_ranks < 1:
        raise ConfigError(f"parameter 'train_ranks' must be >= 1 (got {train_ranks})")
    if ray_address is not None and not ray_address.strip():
        raise ConfigError("parameter 'ray_address' is empty: give 'local', 'auto', host:port or ray://host:port")
    if cfg is not None and train_ranks > 1:
        from ppo_core.ranks import check_ranks

        check_ranks(cfg, train_ranks)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A TCP connection to ``host:port`` (or ``ray://host:port``): Ray itself retries an absent head for minutes."""
    if address == "auto":
        return  # RAY_ADDRESS or this machine's running cluster: ray.init finds it or says so at once
    hostport = address.removeprefix("ray://").rsplit("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"parameter 'ray_address' must be 'local', 'auto', host:port or ray://host:port (got {address!r})")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}. Start its head with "
            "`ray start --head` (see README, 'More than one machine') or check the address"
        ) from None


@contextlib.contextmanager
def execution(
    workers: int = 0, ray_address: str | None = None, train_ranks: int = 1, cfg: PPOConfig | None = None
) -> Iterator[PrefectRunner]:
    """The runner for these execution parameters (checked first, against ``cfg`` when given); a Ray connection
    lives as long as the block."""
    check_execution(workers, ray_address, train_ranks, cfg)
    if not workers and ray_address is None:
        yield PrefectRunner(train_ranks=train_ranks)
        return
    import ray
    from prefect_ray import RayTaskRunner

    local = ray_address in (None, "local")
    if not local:
        check_reachable(ray_address)
    init: dict[str, Any] = {"include_dashboard": False, "runtime_env": {"env_vars": worker_env()}}
    if local:  # "local" starts a new instance even where RAY_ADDRESS names a running one
        init.update(address="local", num_cpus=max(workers, train_ranks))
        # rank actors are processes beyond the CPU count: without this Ray kills the idle shard
        # workers (and their loaded models) while the ranks train
        init["_system_config"] = {"num_workers_soft_limit": max(workers, train_ranks) + train_ranks}
    else:
        init["address"] = ray_address
    try:
        task_runner = RayTaskRunner(init_kwargs=init).__enter__()
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = "a local Ray instance" if local else f"the Ray cluster at {ray_address}"
        raise ConfigError(
            f"cannot start or reach {where}: {exc}. Is the head running (`ray start --head`), and are "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN set as on the cluster?"
        ) from None
    launcher = RayRankLauncher() if train_ranks > 1 else None
    try:
        shards = workers or int(ray.cluster_resources().get("CPU", 1))
        yield PrefectRunner(
            shards=shards, train_ranks=train_ranks, launch_ranks=launcher, task_runner=task_runner,
            remote_options={"max_retries": SHARD_RETRIES, "retry_exceptions": False},
        )
    finally:
        try:
            if launcher is not None:
                launcher.close()
        finally:  # even when killing the ranks failed (a lost connection), Ray is shut down
            task_runner.__exit__(None, None, None)


class RayRankLauncher:
    """Runs training jobs on N ``mx.distributed`` ranks kept as Ray actors for the whole flow run.

    Actors rather than ``mlx.launch``: Ray places them (spread over the nodes
    where it can) and tells each its node's address for the ring hostfile. The
    ranks join their ring group once and keep it and their loaded model from one
    iteration to the next; they hold no CPU reservation between trainings, so
    the shard tasks of the next phases still get every worker. When a rank
    fails or the deadline passes (MLX's collectives have no timeout), every
    rank is killed and the next training starts new ones: a ring group cannot
    be re-formed in a process once made.
    """

    def __init__(self) -> None:
        self._actors: list = []

    def __call__(self, job: TrainJob, ranks: int) -> None:
        import ray

        from ppo_core.ranks import rank_timeout

        if len(self._actors) != ranks:
            self._start(ranks)
        try:
            _wait_ranks(ray, [a.run.remote(job.to_json()) for a in self._actors], rank_timeout())
        except BaseException:
            self.close()  # never raises: the training error is the one to report
            raise

    def _start(self, ranks: int) -> None:
        import ray

        self.close()
        # a runtime env of their own: Ray starts fresh processes for the ranks instead of taking the idle
        # shard workers (whose loaded models would die with the actors); num_cpus=0 keeps every CPU for shards
        actor = ray.remote(num_cpus=0, max_restarts=0, runtime_env={"env_vars": {**worker_env(), "PPO_ROLE": "rank"}})(RankActor)
        self._actors = [actor.options(scheduling_strategy="SPREAD").remote() for _ in range(ranks)]
        hosts: list[str] = []
        try:
            hosts = ray.get([a.address.remote() for a in self._actors], timeout=120)
            _wait_ranks(ray, [a.join.remote(r, hosts) for r, a in enumerate(self._actors)], 120)
        except BaseException as exc:
            self.close()
            raise TrainingError(
                f"{ranks} training ranks could not form their ring group ({', '.join(hosts) or 'no addresses'}): "
                f"{exc}. Each rank listens on a random TCP port of its node: the nodes must reach each other's ports"
            ) from None

    def close(self) -> None:
        import ray

        for a in self._actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001  (a dead actor or a lost connection: nothing left to stop)
                pass
        self._actors = []


def _wait_ranks(ray, refs: list, timeout: float) -> None:
    """Wait for every rank; the first failure (or the deadline) ends the launch at once."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TrainingError(
                f"training ranks did not finish within {timeout:.0f}s; they were stopped and the checkpoint is not advanced"
            )
        try:
            ray.get(done[0])
        except Exception as exc:  # the rank raised, or its actor died
            raise TrainingError(
                f"training rank {refs.index(done[0])} of {len(refs)} failed ({type(exc).__name__}: {str(exc)[-2000:]}); "
                "the other ranks were stopped and the checkpoint is not advanced"
            ) from None


class RankActor:
    """One training rank in its own Ray worker process."""

    def address(self) -> str:
        import ray

        from ppo_core.ranks import free_port

        ip = ray.util.get_node_ip_address()
        return f"{ip}:{free_port(ip)}"

    def join(self, rank: int, hosts: list[str]) -> None:
        """Join the ring group of ``hosts`` as ``rank`` (all ranks must call this together)."""
        from ppo_core import ranks

        directory = Path(tempfile.mkdtemp(prefix="ppo-rank-"))
        os.environ["MLX_RANK"] = str(rank)
        os.environ["MLX_HOSTFILE"] = str(ranks.write_hostfile(hosts, directory))
        self.group = ranks.join_group()

    def run(self, job: dict[str, Any]) -> None:
        from ppo_core import runs
        from ppo_core.config import PPOConfig
        from ppo_core.phases import train_job

        runs.check_visible(PPOConfig(**job["cfg"]))  # rank 0 must write the checkpoint where the flow reads it
        train_job(TrainJob(**job), self.group)

