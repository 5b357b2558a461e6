"""Thin Prefect wrappers: each task calls one ppo_core phase and returns JSON.

Results are plain dicts (paths, hashes, stats), never pickles. Reuse is decided
by ppo_core's phase records (content hashes), not by Prefect's result cache, so
a reused result can never point at a deleted or altered file; a reused phase
finishes in a state named "Cached".
"""

from __future__ import annotations

from typing import Any, Callable

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from ppo_core import phases
from ppo_core.config import PPOConfig
from ppo_core.phases import PhaseResult

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


def _make_task(fn: PhaseFn) -> Task:
    def run_phase(cfg: dict[str, Any], *args: Any) -> State:
        return _finish(fn(PPOConfig(**cfg), *args))

    name = "init" if fn is phases.init_checkpoint else fn.__name__
    return task(name=name, cache_policy=NO_CACHE, persist_result=False, retries=0)(run_phase)


PHASE_TASKS: dict[PhaseFn, Task] = {
    fn: _make_task(fn)
    for fn in (
        phases.init_checkpoint, phases.rollout, phases.attribute, phases.reward,
        phases.value, phases.advantage, phases.train, phases.evaluate,
    )
}


def task_call(fn: PhaseFn, cfg: PPOConfig, *args: Any) -> dict[str, Any]:
    """The pipeline's ``call`` adaptor: run phase ``fn`` as its Prefect task.

    The config crosses the task boundary as its JSON dict (the task rebuilds and
    revalidates it); paths and checkpoints pass through as they are.
    """
    out = PHASE_TASKS[fn](cfg.to_json_dict(), *args)
    return out.result() if isinstance(out, State) else out
