"""Data-parallel training on N processes joined by ``mx.distributed`` (ring backend over TCP).

``launch_local`` starts the ranks on this machine, the way ``mlx.launch
--backend ring`` does, but with a deadline: MLX's ring collectives have no
timeout (a rank that hangs blocks the others forever, busy-spinning), so the
parent watches every rank, and when one fails or time runs out it kills them
all and raises ``TrainingError``. The checkpoint is written by rank 0 only
after the last step, through atomic renames, so a failed launch never
advances it. ``tasks.cluster`` starts the same ranks as Ray actors on a
cluster, kept for the whole flow run. A local rank process runs
``python -m ppo_core.ranks <job.json>`` with ``MLX_RANK`` and ``MLX_HOSTFILE`` set.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ppo_core.config import ConfigError, PPOConfig
from ppo_core.phases import TrainJob
from ppo_core.train import TrainingError

# Seconds one training launch may take before its ranks are killed. A rank that dies ends the launch at once
# (its peers' collectives fail); this bounds only a rank stuck alive, which would block the others forever.
RANK_TIMEOUT_ENV = "PPO_RANK_TIMEOUT"


def check_ranks(cfg: PPOConfig, ranks: int) -> None:
    """Every rank needs at least one rollout of every minibatch."""
    smallest = cfg.rollouts_per_iteration // cfg.num_minibatches
    if ranks > smallest:
        raise ConfigError(
            f"train_ranks={ranks} is more than the {smallest} rollouts of the smallest minibatch "
            f"(batch_size {cfg.batch_size} x samples_per_prompt {cfg.samples_per_prompt} / num_minibatches "
            f"{cfg.num_minibatches}); use at most {smallest} ranks"
        )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_hostfile(hosts: list[str], directory: Path) -> Path:
    """The ring backend's hostfile: one list of 'ip:port' per rank."""
    path = Path(directory) / "hostfile.json"
    path.write_text(json.dumps([[h] for h in hosts]))
    return path


def rank_timeout() -> float:
    return float(os.environ.get(RANK_TIMEOUT_ENV, str(24 * 3600)))


def launch_local(job: TrainJob, ranks: int, timeout: float | None = None) -> None:
    """Run ``job`` on ``ranks`` local processes (one BLAS thread each); raise if any fails or time runs out."""
    timeout = rank_timeout() if timeout is None else timeout
    with tempfile.TemporaryDirectory(prefix="ppo-ranks-") as tmp:
        hostfile = write_hostfile([f"127.0.0.1:{free_port()}" for _ in range(ranks)], Path(tmp))
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job.to_json()))
        logs = [Path(tmp) / f"rank{r}.log" for r in range(ranks)]
        procs = []
        for r in range(ranks):
            env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), "PPO_BLAS_THREADS": "1"}
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ppo_core.ranks", str(job_file)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                ))  # fmt: skip
        _wait_all(procs, logs, timeout)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                raise TrainingError(
                    f"training rank {r} of {len(procs)} exited with code {codes[r]}; the other ranks were stopped "
                    f"and the checkpoint is not advanced. Its last output:\n{_tail(logs[r])}"
                )
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"training ranks did not finish within {timeout:.0f}s (set {RANK_TIMEOUT_ENV}); they were "
                    "stopped and the checkpoint is not advanced"
                )
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def join_group():
    """The ring group named by this process's MLX_RANK and MLX_HOSTFILE (once per process: MLX keeps it)."""
    import mlx.core as mx

    return mx.distributed.init(strict=True, backend="ring")


def run_rank(job: TrainJob) -> None:
    """This process's rank of ``job``: join the ring group named by the environment, then train."""
    from ppo_core.phases import train_job

    train_job(job, join_group())


def main(argv: list[str]) -> int:
    import ppo_core  # noqa: F401  (OpenBLAS before mlx)

    run_rank(TrainJob(**json.loads(Path(argv[1]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
