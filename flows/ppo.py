"""Flow `ppo`: run the next N iterations of a named PPO run.

Every parameter is validated before a model loads. Phases whose outputs are
already on disk (matching their recorded hashes) are reused, so re-running a
failed flow run resumes it. The iteration loop, MLflow tracking and the model
registration live in ``ppo_core.pipeline.run_tracked``; this flow runs each
phase as a Prefect task.
"""

from __future__ import annotations

from typing import Any

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import flow, get_run_logger

from ppo_core import pipeline
from ppo_core.config import load_config
from tasks.phases import PrefectRunner


@flow(name="ppo", log_prints=True, validate_parameters=True)
def ppo(
    run: str = "default",
    iterations: int = 1,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``iterations`` more PPO iterations of run ``run``.

    ``config`` is a TOML/JSON file; ``overrides`` maps config fields to values.
    """
    if iterations < 1:
        raise ValueError(f"parameter 'iterations' must be >= 1 (got {iterations})")
    cfg = load_config(config, {**(overrides or {}), "run": run})
    return pipeline.run_tracked(cfg, iterations, PrefectRunner(), get_run_logger().info)
