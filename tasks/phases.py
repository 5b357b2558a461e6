"""Thin Prefect wrappers: each task calls one ppo_core phase and returns JSON.

Results are plain dicts (paths, hashes, stats), never pickles. Reuse is decided
by ppo_core's phase records (content hashes), not by Prefect's result cache, so
a reused result can never point at a deleted or altered file; a reused phase
finishes in a state named "Cached". ``PrefectRunner`` is the pipeline's runner
inside a flow: given a task runner (Ray's), the shards of a data-parallel phase
are submitted to it together and run on its workers side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State
from prefect.task_runners import TaskRunner

from ppo_core import phases, runs
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
        if name == "merge" and len(args) > 1:  # merge(iteration, phase, parts, ...): one per data phase
            return f"merge-{args[1]}-{iteration}"
        return f"{name}-{iteration}" + (f"-{shard.label}" if shard is not None and not shard.whole else "")

    return make


def _make_task(fn: PhaseFn) -> Task:
    def run_phase(cfg: dict[str, Any], args: list[Any], kwargs: dict[str, Any]) -> State:
        config = PPOConfig(**cfg)
        if "shard" in kwargs:  # a shard may run on another node: it must see the same artifact root
            runs.check_visible(config)
        return _finish(fn(config, *args, **kwargs))

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

    Whole phases run in the flow's process. Shards go to ``task_runner`` (Ray's)
    when one is given, else they run one after another here: MLX work is never
    run in threads of one process. The config crosses the task boundary as its
    JSON dict (the task rebuilds and revalidates it); paths, checkpoints and
    shards pass through as they are.
    """

    task_runner: TaskRunner | None = None
    remote_options: dict[str, Any] | None = None  # Ray options for each shard (retries)

    @staticmethod
    def _parameters(cfg: PPOConfig, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"cfg": cfg.to_json_dict(), "args": list(args), "kwargs": kwargs}

    def call(self, fn: PhaseFn, cfg: PPOConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _data(PHASE_TASKS[fn](**self._parameters(cfg, args, kwargs)))

    def map(self, fn: PhaseFn, cfg: PPOConfig, calls: list[PhaseCall]) -> list[dict[str, Any]]:
        if self.task_runner is None:
            return super().map(fn, cfg, calls)
        from prefect_ray.context import remote_options

        with remote_options(**(self.remote_options or {})):
            futures = [self.task_runner.submit(PHASE_TASKS[fn], self._parameters(cfg, a, k)) for a, k in calls]
        results = []
        for (args, kwargs), future in zip(calls, futures):
            try:
                results.append(_data(future.result()))
            except Exception as exc:
                shard = kwargs.get("shard")
                raise RuntimeError(
                    f"{fn.__name__} of iteration {args[0]}, {shard.label if shard else 'a shard'}, failed on the Ray "
                    f"cluster ({type(exc).__name__}: {str(exc)[-1000:]}); finished shards are kept, re-run to resume"
                ) from exc
        return results
