"""Thin Prefect wrappers: each task calls one ppo_core phase and returns JSON.

Results are plain dicts (paths, hashes, stats), never pickles. Reuse is decided
by ppo_core's phase records (content hashes), not by Prefect's result cache, so
a reused result can never point at a deleted or altered file; a reused phase
finishes in a state named "Cached". ``PrefectRunner`` is the pipeline's runner
inside a flow: the shards of a data-parallel phase are submitted together, so
a Ray task runner runs them on its workers side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from ppo_core import phases
from ppo_core.config import PPOConfig
from ppo_core.phases import PhaseResult
from ppo_core.pipeline import PhaseCall, Runner

PhaseFn = Callable[..., PhaseResult]


def _finish(result: PhaseResult) -> State:
    log = get_run_logger()
    data = result.to_json()
    if result.cached:
        log.info("%s (iteration %d): cached, outputs verified by hash", result.phase, result.iteration)
        return Completed(data=data, name="Cached", message="outputs reused from artifacts")
    tokens = result.stats.get("tokens")
    rate = f", {tokens / result.seconds:.0f} tok/s" if tokens and result.seconds > 0 else ""
    log.info("%s (iteration %d): %.1fs%s", result.phase, result.iteration, result.seconds, rate)
    return Completed(data=data)


def _task_run_name(name: str) -> Callable[[], str]:
    """'rollout-1' or 'rollout-1-part-0-of-2': the iteration and shard are visible in the Prefect UI."""

    def make() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters
        args = params.get("args") or ()
        shard = (params.get("kwargs") or {}).get("shard")
        iteration = args[0] if args and isinstance(args[0], int) else 0
        return f"{name}-{iteration}" + (f"-{shard.label}" if shard is not None and not shard.whole else "")

    return make


def _make_task(fn: PhaseFn) -> Task:
    def run_phase(cfg: dict[str, Any], *args: Any, **kwargs: Any) -> State:
        return _finish(fn(PPOConfig(**cfg), *args, **kwargs))

    name = {phases.init_checkpoint: "init", phases.merge: "merge"}.get(fn, fn.__name__)
    return task(name=name, task_run_name=_task_run_name(name), cache_policy=NO_CACHE, persist_result=False)(run_phase)


PHASE_TASKS: dict[PhaseFn, Task] = {
    fn: _make_task(fn)
    for fn in (
        phases.init_checkpoint, phases.rollout, phases.attribute, phases.reward, phases.value,
        phases.advantage, phases.train, phases.evaluate, phases.merge,
    )
}


def _data(out: Any) -> dict[str, Any]:
    return out.result() if isinstance(out, State) else out


@dataclass
class PrefectRunner(Runner):
    """The pipeline's runner inside a flow: every phase and every shard is a Prefect task run.

    The config crosses the task boundary as its JSON dict (the task rebuilds and
    revalidates it); paths, checkpoints and shards pass through as they are.
    """

    def call(self, fn: PhaseFn, cfg: PPOConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _data(PHASE_TASKS[fn](cfg.to_json_dict(), *args, **kwargs))

    def map(self, fn: PhaseFn, cfg: PPOConfig, calls: list[PhaseCall]) -> list[dict[str, Any]]:
        futures = [PHASE_TASKS[fn].submit(cfg.to_json_dict(), *args, **kwargs) for args, kwargs in calls]
        return [_data(f.result()) for f in futures]
