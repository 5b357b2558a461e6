"""The order of one PPO iteration's phases, independent of who runs them.

``run_iteration`` takes a ``call(phase, fn, *args)`` adaptor: the Prefect flow
passes one that runs each phase as a task; by default the phase functions are
called directly, for notebooks and scripts without Prefect. ``run`` trains
without MLflow; ``run_tracked`` is what the flow does: the same iterations,
each logged to the run's MLflow run, and the last policy registered.
"""

from __future__ import annotations

from typing import Any, Callable

from ppo_core import phases, runs, track
from ppo_core.config import PPOConfig
from ppo_core.phases import checkpoint_dir
from ppo_core.report import build_report

Call = Callable[..., dict[str, Any]]


def direct_call(fn: Callable[..., phases.PhaseResult], cfg: PPOConfig, *args: Any) -> dict[str, Any]:
    return fn(cfg, *args).to_json()


def start(cfg: PPOConfig, call: Call = direct_call) -> list[dict[str, Any]]:
    """Iteration 0: seeded initial adapters and the baseline evaluation (reused once written)."""
    results = [call(phases.init_checkpoint, cfg)]
    if cfg.eval_size:
        results.append(call(phases.evaluate, cfg, 0, checkpoint_dir(cfg, 0)))
    runs.write_manifest(cfg, 0, results)
    return results


def run_iteration(cfg: PPOConfig, iteration: int, call: Call = direct_call) -> list[dict[str, Any]]:
    """All phases of ``iteration`` (each reused if its outputs are intact), then its manifest."""
    prev = checkpoint_dir(cfg, iteration - 1)
    ro = call(phases.rollout, cfg, iteration, prev)
    rollouts = ro["outputs"]["rollouts"]
    sa = call(phases.attribute, cfg, iteration, rollouts, prev)
    rw = call(phases.reward, cfg, iteration, rollouts, sa["outputs"]["sa_pairs"])
    va = call(phases.value, cfg, iteration, rollouts, prev)
    ad = call(phases.advantage, cfg, iteration, rw["outputs"]["rewards"], va["outputs"]["values"])
    tr = call(phases.train, cfg, iteration, rollouts, sa["outputs"]["sa_pairs"], ad["outputs"]["advantages"], prev)
    results = [ro, sa, rw, va, ad, tr]
    if cfg.eval_size:
        results.append(call(phases.evaluate, cfg, iteration, checkpoint_dir(cfg, iteration)))
    runs.write_manifest(cfg, iteration, results)
    return results


def run(cfg: PPOConfig, iterations: int, call: Call = direct_call) -> dict[int, list[dict[str, Any]]]:
    """Run the next ``iterations`` iterations of ``cfg.run`` without Prefect or MLflow."""
    runs.check_inputs(cfg)
    with runs.run_lock(cfg):
        runs.pin_config(cfg)
        start(cfg, call)
        first = runs.next_iteration(cfg)
        return {it: run_iteration(cfg, it, call) for it in range(first, first + iterations)}


def run_tracked(
    cfg: PPOConfig, iterations: int, call: Call = direct_call, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the next ``iterations`` iterations of ``cfg.run`` with MLflow tracking.

    Each finished iteration is logged at step = iteration; the MLflow run ends
    FINISHED, or FAILED with the reason as tag ``failure_reason``. On success
    the last iteration's policy adapter becomes a version of registered model
    ``ppo-<run>`` and the run's HTML report is rebuilt and logged.
    """
    runs.check_inputs(cfg)
    with runs.run_lock(cfg):
        runs.pin_config(cfg)
        track.ensure_run(cfg)
        track.set_status(cfg, "RUNNING")
        try:
            baseline = start(cfg, call)
            track.log_iteration(cfg, 0, runs.iteration_metrics(baseline), [], cfg.iter_dir(0))
            first = runs.next_iteration(cfg)
            done: dict[int, dict[str, float]] = {}
            for iteration in range(first, first + iterations):
                metrics = runs.iteration_metrics(run_iteration(cfg, iteration, call))
                track.log_iteration(cfg, iteration, metrics, runs.step_rows(cfg, iteration), cfg.iter_dir(iteration))
                done[iteration] = metrics
                log(
                    f"iteration {iteration}: score {metrics.get('reward/score', float('nan')):.3f}  "
                    f"kl {metrics.get('reward/kl', float('nan')):.3f}  "
                    f"eval {metrics.get('evaluate/eval_score', float('nan')):.3f}"
                )
            version = track.register_policy(cfg, first + iterations - 1)
            log(f"registered policy of iteration {first + iterations - 1} as {version.name} version {version.version}")
            report_path = build_report(cfg.artifact_root, cfg.run)
            track.log_report(cfg, report_path)
            log(f"report: {report_path}")
        except BaseException as exc:
            track.set_status(cfg, "FAILED", f"{type(exc).__name__}: {exc}")
            raise
        track.set_status(cfg, "FINISHED")
    return {
        "run": cfg.run,
        "iterations": done,
        "artifact_root": str(cfg.artifact_root),
        "registered_model": {"name": version.name, "version": int(version.version)},
        "report": str(report_path),
    }
