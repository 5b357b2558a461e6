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

from ppo_core import runs, track
from ppo_core.config import PPOConfig, load_config
from ppo_core.phases import checkpoint_dir
from tasks.phases import (
    advantage_task,
    attribute_task,
    evaluate_task,
    init_task,
    reward_task,
    rollout_task,
    train_task,
    value_task,
    run_task,
)


def run_iteration(cfg: PPOConfig, iteration: int) -> list[dict[str, Any]]:
    c = cfg.to_json_dict()
    prev = str(checkpoint_dir(cfg, iteration - 1))
    ro = run_task(rollout_task, c, iteration, prev)
    sa = run_task(attribute_task, c, iteration, ro["outputs"]["rollouts"], prev)
    rw = run_task(reward_task, c, iteration, ro["outputs"]["rollouts"], sa["outputs"]["sa_pairs"])
    va = run_task(value_task, c, iteration, ro["outputs"]["rollouts"], prev)
    ad = run_task(advantage_task, c, iteration, rw["outputs"]["rewards"], va["outputs"]["values"])
    tr = run_task(train_task, 
        c, iteration, ro["outputs"]["rollouts"], sa["outputs"]["sa_pairs"], ad["outputs"]["advantages"], prev
    )
    results = [ro, sa, rw, va, ad, tr]
    if cfg.eval_size:
        results.append(run_task(evaluate_task, c, iteration, str(checkpoint_dir(cfg, iteration))))
    return results


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
    log = get_run_logger()
    if iterations < 1:
        raise ValueError(f"parameter 'iterations' must be >= 1 (got {iterations})")
    cfg = load_config(config, {**(overrides or {}), "run": run})
    runs.check_inputs(cfg)
    with runs.run_lock(cfg):
        runs.pin_config(cfg)
        track.ensure_run(cfg)
        track.set_status(cfg, "RUNNING")
        try:
            summary = _iterate(cfg, iterations, log)
        except BaseException as exc:
            track.set_status(cfg, "FAILED", f"{type(exc).__name__}: {exc}")
            raise
        track.set_status(cfg, "FINISHED")
    return summary


def _iterate(cfg: PPOConfig, iterations: int, log) -> dict[str, Any]:
    c = cfg.to_json_dict()
    init = run_task(init_task, c)
    if cfg.eval_size and 0 not in runs.completed_iterations(cfg):
        # iteration 0 = the untrained policy: the baseline of every learning curve
        base = run_task(evaluate_task, c, 0, str(checkpoint_dir(cfg, 0)))
        runs.write_manifest(cfg, 0, [init, base])
        track.log_iteration(cfg, 0, runs.iteration_metrics([base]), [], cfg.iter_dir(0))
    start = runs.next_iteration(cfg)
    done: dict[int, dict[str, float]] = {}
    for iteration in range(start, start + iterations):
        results = run_iteration(cfg, iteration)
        runs.write_manifest(cfg, iteration, results)
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
