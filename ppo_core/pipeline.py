"""The order of one PPO iteration's phases, independent of who runs them: the one wiring.

``run_iteration`` takes a ``call(fn, cfg, *args)`` adaptor: the Prefect flow
passes one that runs each phase as a task; by default the phase functions are
called directly, for notebooks, scripts, tests and benchmarks without Prefect.
``run`` trains without MLflow; ``run_tracked`` is what the flow does: the same
iterations, each logged to the run's MLflow run, and the last policy registered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ppo_core import phases, registry, runs, track
from ppo_core.config import PPOConfig
from ppo_core.report import build_report

Call = Callable[..., dict[str, Any]]


def direct_call(fn: Callable[..., phases.PhaseResult], cfg: PPOConfig, *args: Any) -> dict[str, Any]:
    return fn(cfg, *args).to_json()


def output(result: dict[str, Any], name: str) -> Path:
    """Output ``name`` of a phase result (results are JSON, so paths travel as strings)."""
    return Path(result["outputs"][name])


def start(cfg: PPOConfig, call: Call = direct_call) -> list[dict[str, Any]]:
    """Iteration 0: seeded initial adapters and the baseline evaluation (reused once written)."""
    results = [call(phases.init_checkpoint, cfg)]
    if cfg.eval_size:
        results.append(call(phases.evaluate, cfg, 0, cfg.layout.checkpoint(0)))
    runs.write_manifest(cfg, 0, results)
    return results


def run_iteration(cfg: PPOConfig, iteration: int, call: Call = direct_call) -> list[dict[str, Any]]:
    """All phases of ``iteration`` (each reused if its outputs are intact), then its manifest.

    Results come back in ``phases.ITERATION_PHASES`` order.
    """
    prev = cfg.layout.checkpoint(iteration - 1)
    ro = call(phases.rollout, cfg, iteration, prev)
    rollouts = output(ro, "rollouts")
    sa = call(phases.attribute, cfg, iteration, rollouts, prev)
    rw = call(phases.reward, cfg, iteration, rollouts, output(sa, "sa_pairs"))
    va = call(phases.value, cfg, iteration, rollouts, prev)
    ad = call(phases.advantage, cfg, iteration, output(rw, "rewards"), output(va, "values"))
    tr = call(phases.train, cfg, iteration, rollouts, output(sa, "sa_pairs"), output(ad, "advantages"), prev)
    results = [ro, sa, rw, va, ad, tr]
    if cfg.eval_size:
        results.append(call(phases.evaluate, cfg, iteration, cfg.layout.checkpoint(iteration)))
    runs.write_manifest(cfg, iteration, results)
    return results


def iteration_metrics(phase_results: list[dict[str, Any]]) -> dict[str, float]:
    """The per-iteration numbers logged to MLflow at step = iteration (init contributes none)."""
    out: dict[str, float] = {}
    for r in phase_results:
        phase = r["phase"]
        if phase not in phases.ITERATION_PHASES:
            continue
        out.update({f"{phase}/{k}": float(v) for k, v in r["stats"].items() if k != "tokens"})
        if r["seconds"] > 0 and not r["cached"]:
            out[f"time/{phase}_seconds"] = r["seconds"]
            if "tokens" in r["stats"]:
                out[f"time/{phase}_tokens_per_s"] = r["stats"]["tokens"] / r["seconds"]
    return out


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
            track.log_iteration(cfg, 0, iteration_metrics(baseline), [])
            first = runs.next_iteration(cfg)
            done: dict[int, dict[str, float]] = {}
            for iteration in range(first, first + iterations):
                metrics = iteration_metrics(run_iteration(cfg, iteration, call))
                track.log_iteration(cfg, iteration, metrics, runs.step_rows(cfg, iteration))
                done[iteration] = metrics
                log(
                    f"iteration {iteration}: score {metrics.get('reward/score', float('nan')):.3f}  "
                    f"kl {metrics.get('reward/kl', float('nan')):.3f}  "
                    f"eval {metrics.get('evaluate/eval_score', float('nan')):.3f}"
                )
            version = registry.register_policy(cfg, first + iterations - 1)
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
