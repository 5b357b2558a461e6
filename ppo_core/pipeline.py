"""The order of one PPO iteration's phases, independent of who runs them: the one wiring.

Every function here takes a ``Runner``: how a phase is called (``call``) and
how the shards of a data-parallel phase are run side by side (``map``). The
default ``Runner`` calls the phase functions directly, one after another, for
notebooks, scripts, tests and benchmarks without Prefect; the Prefect flow
passes one that runs each phase and each shard as a task (on Ray workers when
the flow has a Ray task runner). ``run`` trains without MLflow; ``run_tracked``
is what the flow does: the same iterations, each logged to the run's MLflow
run, and the last policy registered.

MLflow is a view of the artifact store, never the other way round: an
iteration is logged from its manifest once it has finished, with a timestamp
fixed by the iteration, so logging it twice (after a kill) changes nothing, and
what a run could not log (killed, or its tracking server away) is logged by the
next flow run or ``sync``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ppo_core import phases, registry, runs, track
from ppo_core.config import ConfigError, PPOConfig
from ppo_core.faults import scope
from ppo_core.layout import iter_label
from ppo_core.phases import Shard
from ppo_core.report import build_report
from ppo_core.tables import atomic_write_text

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
    with scope(f"{iter_label(0)}/manifest"):
        runs.write_manifest(cfg, 0, results)
    return results


def repair(cfg: PPOConfig, iteration: int, runner: Runner | None = None) -> None:
    """Recompute finished ``iteration`` if a file of it no longer matches its manifest (bit rot, an edit).

    Its intact phases are reused and the damaged outputs written again. They
    must come out as the manifest recorded them: later iterations were trained
    on those bytes. Different bytes (the code or a library changed since) are
    an error, and the manifest keeps what it recorded.
    """
    if not runs.damaged_artifacts(cfg, iteration):
        return
    manifest = cfg.layout.manifest(iteration)
    recorded = manifest.read_bytes()
    if iteration == 0:
        start(cfg, runner)
    else:
        run_iteration(cfg, iteration, runner)
    if manifest.read_bytes() != recorded:
        atomic_write_text(manifest, recorded.decode())  # the run's lineage is what was recorded, not what came out now
    still = runs.damaged_artifacts(cfg, iteration)
    if still:
        raise runs.ArtifactIntegrityError(
            f"files {', '.join(still)} of run '{cfg.run}' differ from iteration {iteration}'s manifest even after "
            "recomputing them (has the code or a library changed since?); later iterations were trained on the "
            "recorded bytes: restore the files or start a new run name"
        )


def repair_finished(cfg: PPOConfig, runner: Runner | None = None) -> None:
    """``repair`` every finished iteration, oldest first: what a run checks before it goes on (tables are read by
    SQL and the report, not only by the next iteration)."""
    for iteration in cfg.layout.completed_iterations():
        repair(cfg, iteration, runner)


def run_iteration(cfg: PPOConfig, iteration: int, runner: Runner | None = None) -> list[dict[str, Any]]:
    """All phases of ``iteration`` (each reused if its outputs are intact), then its manifest.

    Results come back in ``phases.ITERATION_PHASES`` order (without ``value``
    when the estimator has no value model).
    """
    runner = runner or Runner()
    prev = cfg.layout.checkpoint(iteration - 1)
    repair(cfg, iteration - 1, runner)  # never train on from altered weights or tables
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
    with scope(f"{iter_label(iteration)}/manifest"):
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
        repair_finished(cfg, runner)
        start(cfg, runner)
        first = runs.next_iteration(cfg)
        return {it: run_iteration(cfg, it, runner) for it in range(first, first + iterations)}


def manifest_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """``iteration_metrics`` of a finished iteration, read back from its manifest (``runs.read_manifest``)."""
    return iteration_metrics([{"phase": phase, **entry} for phase, entry in manifest["phases"].items()])


def log_finished_iterations(cfg: PPOConfig) -> list[int]:
    """Log to MLflow every finished iteration (iteration 0's baseline included) that it does not hold yet."""
    logged = track.last_logged_iteration(cfg)
    pending = [i for i in cfg.layout.completed_iterations() if i > logged]
    for i in pending:
        manifest = runs.read_manifest(cfg, i)
        track.log_iteration(cfg, i, manifest_metrics(manifest), runs.step_rows(cfg, i), runs.finished_at_ms(cfg, manifest, i))
    return pending


def publish(cfg: PPOConfig, iteration: int, report_path: Path) -> tuple[Any, list[int]]:
    """What a finished flow run tells MLflow: every finished iteration it lacks, ``iteration``'s policy registered,
    the report, FINISHED. Every step is idempotent; returns the ModelVersion and the iterations logged now.
    """
    logged = log_finished_iterations(cfg)
    with scope("registry"):
        version = registry.register_policy(cfg, iteration)
    with scope("finish"):
        track.log_report(cfg, report_path)
        track.set_status(cfg, "FINISHED")
    return version, logged


MAX_ITERATIONS = 1000  # per flow run (a deployment's parameters are untrusted): a run continues where the last stopped


def last_iteration(cfg: PPOConfig, first: int, iterations: int, until: int | None) -> int:
    """The last iteration a flow run trains: ``iterations`` more from ``first``, or up to ``until``.

    ``until`` makes the request idempotent: the same command after a crash
    finishes the same work instead of adding iterations.
    """
    if until is None:
        return first + iterations - 1
    if until < first - 1:
        raise ConfigError(
            f"parameter 'until': run '{cfg.run}' has finished iteration {first - 1} already (got until={until}); "
            "name a later iteration, or use 'iterations' to add more"
        )
    if until - first + 1 > MAX_ITERATIONS:
        raise ConfigError(
            f"parameter 'until': {until} is {until - first + 1} iterations after run '{cfg.run}''s last finished one "
            f"({first - 1}); one flow run trains at most {MAX_ITERATIONS}"
        )
    return until


class Tracking:
    """The MLflow side of one flow run: while the tracking server is away, training goes on.

    A call made through it that finds the server unreachable is dropped with
    one warning; every finished iteration stays in the artifact store, and
    the next call that reaches the server logs what it missed.
    """

    def __init__(self, cfg: PPOConfig, log: Callable[[str], None]) -> None:
        self.cfg, self.log = cfg, log
        self.away: track.TrackingUnavailable | None = None

    def __call__(self, fn: Callable[[], Any]) -> Any:
        try:
            track.check_reachable(self.cfg)
            result = fn()
        except Exception as exc:
            away = track.unavailable(self.cfg, exc)
            if away is None:
                raise
            if self.away is None:
                self.log(f"WARNING: {away}; training goes on and every artifact is written: what MLflow misses "
                         "is logged when the server is back")
            self.away = away
            return None
        if self.away is not None:
            self.log("the MLflow tracking server answers again")
            self.away = None
        return result


def run_tracked(
    cfg: PPOConfig,
    iterations: int,
    runner: Runner | None = None,
    log: Callable[[str], None] = print,
    owner: str | None = None,
    on_previous_owner: Callable[[str], None] | None = None,
    until: int | None = None,
) -> dict[str, Any]:
    """Run the next ``iterations`` iterations of ``cfg.run`` (or up to iteration ``until``) with MLflow tracking.

    Each finished iteration is logged at step = iteration; the MLflow run ends
    FINISHED, or FAILED with the reason as tag ``failure_reason``. On success
    the last iteration's policy adapter becomes a version of registered model
    ``ppo-<run>`` and the run's HTML report is rebuilt and logged. When the
    tracking server is unreachable the iterations still run; the flow run then
    fails at the end with ``TrackingUnavailable``, naming what ``sync`` (or the
    next flow run) will log.

    ``owner`` names this process's run in the run's lock (a Prefect flow run);
    ``on_previous_owner`` gets each line earlier holders left there (a name,
    and how it ended unless it died holding the lock) that no orchestrator has
    recorded yet, so it can record a crash, or a final state that never
    reached it; a line it raises on is handed on to the next holder.
    """
    runs.check_inputs(cfg)
    with runs.run_lock(cfg, owner) as earlier:
        for line in list(earlier) if on_previous_owner is not None else []:
            try:
                on_previous_owner(line)
                earlier.remove(line)  # recorded: not handed on to the next holder
            except Exception as exc:  # the orchestrator is away: the next holder tries again
                log(f"could not record how an earlier holder of run '{cfg.run}' ended ({line}): {exc}")
        for stale in runs.remove_stale_temp_files(cfg):
            log(f"removed {stale}, a temporary file left by a killed process")
        runs.pin_config(cfg)
        first = runs.next_iteration(cfg)
        last = last_iteration(cfg, first, iterations, until)
        tracking = Tracking(cfg, log)
        with scope("start"):
            tracking(lambda: track.set_status(cfg, "RUNNING"))
        try:
            repair_finished(cfg, runner)
            start(cfg, runner)
            # and what an earlier flow run could not log (killed, or its server away)
            tracking(lambda: log_finished_iterations(cfg))
            unlogged: list[int] = []  # iterations of this flow run that MLflow may lack
            done: dict[int, dict[str, float]] = {}
            for iteration in range(first, last + 1):
                run_iteration(cfg, iteration, runner)
                logged = tracking(lambda: log_finished_iterations(cfg)) is not None
                unlogged = [] if logged else [*unlogged, iteration]
                done[iteration] = metrics = manifest_metrics(runs.read_manifest(cfg, iteration))
                log(
                    f"iteration {iteration}: score {metrics.get('reward/score', float('nan')):.3f}  "
                    f"kl {metrics.get('reward/kl', float('nan')):.3f}  "
                    f"eval {metrics.get('evaluate/eval_score', float('nan')):.3f}"
                )
            with scope("report"):
                report_path = build_report(cfg.artifact_root, cfg.run)
            log(f"report: {report_path}")
            published = tracking(lambda: publish(cfg, last, report_path))
            if published is None:
                missing = f"the metrics of iteration(s) {', '.join(map(str, unlogged))} and " if unlogged else ""
                raise track.TrackingUnavailable(
                    f"iterations up to {last} of run '{cfg.run}' finished and every artifact is written under "
                    f"{cfg.layout.run_dir}, but {tracking.away}: {missing}the registration of iteration {last}'s "
                    f"policy {'are' if missing else 'is'} not in MLflow yet. When the server is back, "
                    f"`ppo sync --run {cfg.run}` logs them (so does the run's next flow run)"
                )
            version, _ = published
            log(f"registered policy of iteration {last} as {version.name} version {version.version}")
        except BaseException as exc:
            tracking(lambda: track.set_status(cfg, "FAILED", f"{type(exc).__name__}: {exc}"))
            raise
    return {
        "run": cfg.run,
        "iterations": done,
        "artifact_root": str(cfg.artifact_root),
        "registered_model": {"name": version.name, "version": int(version.version)},
        "report": str(report_path),
    }


def sync(cfg: PPOConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Bring MLflow up to date with the artifact store, training nothing.

    Logs every finished iteration MLflow lacks, registers the latest finished
    iteration's policy (unless it is already a version) and uploads the
    report: what a flow run whose tracking server went away could not do.
    """
    with runs.run_lock(cfg):
        done = cfg.layout.completed_iterations()
        if not [i for i in done if i > 0]:
            raise ConfigError(f"run '{cfg.run}' has no finished iteration under {cfg.artifact_root} to log")
        track.check_reachable(cfg)
        version, logged = publish(cfg, done[-1], build_report(cfg.artifact_root, cfg.run))
        log(f"logged iterations {', '.join(map(str, logged))}" if logged else "every finished iteration was logged already")
        log(f"iteration {done[-1]}'s policy is {version.name} version {version.version}")
    return {"run": cfg.run, "logged_iterations": logged, "registered_model": {"name": version.name, "version": int(version.version)}}
