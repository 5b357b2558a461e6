"""Flow `ppo`: run the next N iterations of a named PPO run.

Every parameter is validated before a model loads. Phases whose outputs are
already on disk (matching their recorded hashes) are reused, so re-running a
failed flow run resumes it.
"""

from __future__ import annotations

from typing import Any

from flows import _env  # noqa: F401
import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import flow, get_run_logger

from ppo_core import pipeline, runs, track
from ppo_core.config import PPOConfig, load_config
from tasks.phases import task_call


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
    runs.check_inputs(cfg)
    with runs.run_lock(cfg):
        runs.pin_config(cfg)
        track.ensure_run(cfg)
        track.set_status(cfg, "RUNNING")
        try:
            summary = _iterate(cfg, iterations)
        except BaseException as exc:
            track.set_status(cfg, "FAILED", f"{type(exc).__name__}: {exc}")
            raise
        track.set_status(cfg, "FINISHED")
    return summary


def _iterate(cfg: PPOConfig, iterations: int) -> dict[str, Any]:
    log = get_run_logger()
    baseline = pipeline.start(cfg, task_call)
    track.log_iteration(cfg, 0, runs.iteration_metrics(baseline), [], cfg.iter_dir(0))
    first = runs.next_iteration(cfg)
    done: dict[int, dict[str, float]] = {}
    for iteration in range(first, first + iterations):
        results = pipeline.run_iteration(cfg, iteration, task_call)
        metrics = runs.iteration_metrics(results)
        track.log_iteration(cfg, iteration, metrics, runs.step_rows(cfg, iteration), cfg.iter_dir(iteration))
        done[iteration] = metrics
        log.info(
            "iteration %d: score %.3f  kl %.3f  eval %.3f",
            iteration,
            metrics.get("reward/score", float("nan")),
            metrics.get("reward/kl", float("nan")),
            metrics.get("evaluate/eval_score", float("nan")),
        )
    return {"run": cfg.run, "iterations": done, "artifact_root": str(cfg.artifact_root)}
