"""Flow `ppo`: run the next N iterations of a named PPO run.

Every parameter is validated before a model loads. Phases whose outputs are
already on disk (matching their recorded hashes) are reused, so re-running a
failed flow run resumes it. The iteration loop, MLflow tracking and the model
registration live in ``ppo_core.pipeline.run_tracked``; this flow runs each
phase as a Prefect task, in its own process or on a Ray cluster
(``tasks.cluster.execution``: ``workers``, ``ray_address``, ``train_ranks``).
"""

from __future__ import annotations

from typing import Any

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import flow, get_run_logger
from prefect.runtime import deployment, flow_run

from ppo_core import pipeline
from ppo_core.pipeline import MAX_ITERATIONS
from ppo_core.allowed_paths import check_allowed_paths, check_config_file
from ppo_core.config import load_config
from tasks.cluster import execution
from tasks.flow_runs import settle_previous


@flow(name="ppo", log_prints=True, validate_parameters=True, persist_result=False)
def ppo(
    run: str = "default",
    iterations: int = 1,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    workers: int = 0,
    ray_address: str | None = None,
    train_ranks: int = 1,
    until: int | None = None,
) -> dict[str, Any]:
    """Run ``iterations`` more PPO iterations of run ``run``, or up to iteration ``until``.

    With ``until`` the same parameters after a crash finish the same work (the
    finished phases are reused) instead of adding iterations.

    ``config`` is a TOML/JSON file; ``overrides`` maps config fields to values.
    ``workers`` > 0 runs the data-parallel phases as that many shards on Ray
    workers (a local Ray instance unless ``ray_address`` names a cluster:
    ``auto``, ``host:port`` or ``ray://host:10001``); ``train_ranks`` > 1
    trains data-parallel on that many ``mx.distributed`` ranks.
    """
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"parameter 'iterations' must be between 1 and {MAX_ITERATIONS} (got {iterations})")
    if until is not None and until < 1:
        raise ValueError(f"parameter 'until' must be 1 or more (got {until})")
    from_deployment = deployment.id is not None  # parameters chosen by whoever may start a run
    if from_deployment:
        check_config_file(config)
    cfg = load_config(config, {**(overrides or {}), "run": run})
    if from_deployment:  # only paths under the allowed roots, and the run uses them as checked
        cfg = check_allowed_paths(cfg, config)
    this_run = f"flow run {flow_run.id}"
    with execution(workers, ray_address, train_ranks, cfg) as runner:
        return pipeline.run_tracked(
            cfg, iterations, runner, get_run_logger().info, owner=this_run,
            on_previous_owner=lambda previous: settle_previous(previous, f"recorded by {this_run} of run '{run}'"),
            until=until,
        )
