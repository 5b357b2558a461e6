"""The order of one PPO iteration's phases, independent of who runs them: the one wiring.

Every function here takes a ``Runner``: how a phase is called (``call``) and
how the shards of a data-parallel phase are run side by side (``map``). The
default ``Runner`` calls the phase functions directly, one after another, for
notebooks, scripts, tests and benchmarks without Prefect; the Prefect flow
passes one that runs each phase and each shard as a task (on Ray workers when
the flow has a Ray task runner). ``run`` trains without MLflow; ``run_tracked``
is what the flow does: the same iterations, each logged to the run's MLflow
run, and the last policy registered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ppo_core import phases, registry, runs, track
from ppo_core.config import PPOConfig
from ppo_core.phases import Shard
from ppo_core.report import build_report

PhaseCall = tuple[tuple[Any, ...], dict[str, Any]]  # (positional args after cfg, keyword args)


@dataclass
class Runner:
    """Runs phases in this process, one after another.

    ``shards`` > 1 splits the data-parallel phases; ``train_ranks`` > 1 trains
    on that many ``mx.distributed`` ranks, started by ``launch_ranks``
    (default: processes on this machine).
    """

    shards: int = 1
    train_ranks: int = 1
    launch_ranks: phases.RankLauncher | None = None

    def train_options(self) -> dict[str, Any]:
        return {"ranks": self.train_ranks, "launch": self.launch_ranks} if self.train_ranks > 1 else {}

    def call(self, fn: Callable[..., phases.PhaseResult], cfg: PPOConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return fn(cfg, *args, **kwargs).to_json()

    def map(self, fn: Callable[..., phases.PhaseResult], cfg: PPOConfig, calls: list[PhaseCall]) -> list[dict[str, Any]]:
        """Run ``fn`` once per call; a runner with workers runs them side by side."""
        return [self.call(fn, cfg, *args, **kwargs) for args, kwargs in calls]


def output(result: dict[str, Any], name: str) -> Path:
    """Output ``name`` of a phase result (results are JSON, so paths travel as strings)."""
    return Path(result["outputs"][name])


def _data_phase(runner: Runner, fn: Callable[..., phases.PhaseResult], cfg: PPOConfig, iteration: int, *args: Any) -> dict[str, Any]:
    """A data-parallel phase: whole when unsharded or already done, else its shards side by side, then merged."""
    name = fn.__name__
    rows = cfg.eval_size if name == "evaluate" else cfg.rollouts_per_iteration
    count = min(runner.shards, rows)
    if count <= 1 or phases.done(name, cfg, iteration, *args) is not None:
        return runner.call(fn, cfg, iteration, *args)
    t0 = time.perf_counter()
    parts = runner.map(fn, cfg, [((iteration, *args), {"shard": shard}) for shard in Shard.split(count)])
    table = phases.DATA_PHASES[name].table
    # side by side, the shards took as long as the slowest; reused shards count the time they first took
    shard_seconds = max(time.perf_counter() - t0, max(p["seconds"] for p in parts))
    return runner.call(
        phases.merge, cfg, iteration, name, [output(p, table) for p in parts], *args, shard_seconds=shard_seconds
    )


def start(cfg: PPOConfig, runner: Runner | None = None) -> list[dict[str, Any]]:
    """Iteration 0: seeded initial adapters and the baseline evaluation (reused once written)."""
    runner = runner or Runner()
    results = [runner.call(phases.init_checkpoint, cfg)]
    if cfg.eval_size:
        results.append(_data_phase(runner, phases.evaluate, cfg, 0, cfg.layout.checkpoint(0)))
    runs.write_manifest(cfg, 0, results)
    return results


def run_iteration(cfg: PPOConfig, iteration: int, runner: Runner | None = None) -> list[dict[str, Any]]:
    """All phases of ``iteration`` (each reused if its outputs are intact), then its manifest.

    Results come back in ``phases.ITERATION_PHASES`` order (without ``value``
    when the estimator has no value model).
    """
    runner = runner or Runner()
    prev = cfg.layout.checkpoint(iteration - 1)
    damaged = runs.damaged_checkpoint(cfg, iteration - 1)
    if damaged:
        # a finished iteration's checkpoint no longer matches its manifest (bit rot, an edit): redo that
        # iteration, whose other phases are reused, instead of training on from altered weights
        if iteration == 1:
            start(cfg, runner)
        else:
            run_iteration(cfg, iteration - 1, runner)
        still = runs.damaged_checkpoint(cfg, iteration - 1)
        if still:
            raise runs.ArtifactIntegrityError(
                f"checkpoint files {', '.join(still)} of run '{cfg.run}' differ from iteration {iteration - 1}'s "
                "manifest even after recomputing them"
            )
    ro = _data_phase(runner, phases.rollout, cfg, iteration, prev)
    rollouts = output(ro, "rollouts")
    sa = _data_phase(runner, phases.attribute, cfg, iteration, rollouts, prev)
    rw = runner.call(phases.reward, cfg, iteration, rollouts, output(sa, "sa_pairs"))
    # the critic-free estimators have no value model to ask
    va = _data_phase(runner, phases.value, cfg, iteration, rollouts, prev) if cfg.uses_critic else None
    ad = runner.call(phases.advantage, cfg, iteration, output(rw, "rewards"), output(va, "values") if va else None)
    tr = runner.call(
        phases.train, cfg, iteration, rollouts, output(sa, "sa_pairs"), output(ad, "advantages"), prev, **runner.train_options()
    )
    results = [r for r in (ro, sa, rw, va, ad, tr) if r is not None]
    if cfg.eval_size:
        results.append(_data_phase(runner, phases.evaluate, cfg, iteration, cfg.layout.checkpoint(iteration)))
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
        # a reused phase reports the seconds it took when it ran: a resumed run logs what an uninterrupted one does
        if r["seconds"] > 0:
            out[f"time/{phase}_seconds"] = r["seconds"]
            if "tokens" in r["stats"]:
                out[f"time/{phase}_tokens_per_s"] = r["stats"]["tokens"] / r["seconds"]
    return out


def run(cfg: PPOConfig, iterations: int, runner: Runner | None = None) -> dict[int, list[dict[str, Any]]]:
    """Run the next ``iterations`` iterations of ``cfg.run`` without Prefect or MLflow."""
    runs.check_inputs(cfg)
    with runs.run_lock(cfg):
        runs.remove_stale_temp_files(cfg)
        runs.pin_config(cfg)
        start(cfg, runner)
        first = runs.next_iteration(cfg)
        return {it: run_iteration(cfg, it, runner) for it in range(first, first + iterations)}


def run_tracked(
    cfg: PPOConfig,
    iterations: int,
    runner: Runner | None = None,
    log: Callable[[str], None] = print,
    owner: str | None = None,
    on_dead_owner: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the next ``iterations`` iterations of ``cfg.run`` with MLflow tracking.

    Each finished iteration is logged at step = iteration; the MLflow run ends
    FINISHED, or FAILED with the reason as tag ``failure_reason``. On success
    the last iteration's policy adapter becomes a version of registered model
    ``ppo-<run>`` and the run's HTML report is rebuilt and logged.

    ``owner`` names this process's run in the run's lock (a Prefect flow run);
    ``on_dead_owner`` gets what a previous holder that died holding the lock
    left there, so its orchestrator can record the crash.
    """
    runs.check_inputs(cfg)
    with runs.run_lock(cfg, owner) as previous:
        if previous and on_dead_owner is not None:
            on_dead_owner(previous)
        for stale in runs.remove_stale_temp_files(cfg):
            log(f"removed {stale}, a temporary file left by a killed process")
        runs.pin_config(cfg)
        track.ensure_run(cfg)
        track.set_status(cfg, "RUNNING")
        try:
            baseline = start(cfg, runner)
            track.log_iteration(cfg, 0, iteration_metrics(baseline), [])
            first = runs.next_iteration(cfg)
            done: dict[int, dict[str, float]] = {}
            for iteration in range(first, first + iterations):
                metrics = iteration_metrics(run_iteration(cfg, iteration, runner))
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
