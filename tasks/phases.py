"""Thin Prefect wrappers: each task calls one ppo_core phase and returns JSON.

Results are plain dicts (paths, hashes, stats), never pickles. Reuse is decided
by ppo_core's phase records (content hashes), not by Prefect's result cache, so
a reused result can never point at a deleted or altered file; a reused phase
finishes in a state named "Cached".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from ppo_core import phases
from ppo_core.config import PPOConfig
from ppo_core.phases import PhaseResult

TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False, "retries": 0}


def _finish(result: PhaseResult):
    log = get_run_logger()
    data = result.to_json()
    tokens = result.stats.get("tokens")
    if result.cached:
        log.info("%s (iteration %d): cached, outputs verified by hash", result.phase, result.iteration)
        return Completed(data=data, name="Cached", message="outputs reused from artifacts")
    rate = f", {tokens / result.seconds:.0f} tok/s" if tokens and result.seconds > 0 else ""
    log.info("%s (iteration %d): %.1fs%s", result.phase, result.iteration, result.seconds, rate)
    return Completed(data=data)


def run_task(fn, *args: Any) -> dict[str, Any]:
    """Call a phase task and return its JSON result (tasks finish with explicit states)."""
    out = fn(*args)
    return out.result() if isinstance(out, State) else out


def _cfg(cfg: dict[str, Any]) -> PPOConfig:
    return PPOConfig(**cfg)


@task(name="init", **TASK_OPTIONS)
def init_task(cfg: dict[str, Any]):
    return _finish(phases.init_checkpoint(_cfg(cfg)))


@task(name="rollout", **TASK_OPTIONS)
def rollout_task(cfg: dict[str, Any], iteration: int, checkpoint: str):
    return _finish(phases.rollout(_cfg(cfg), iteration, Path(checkpoint)))


@task(name="attribute", **TASK_OPTIONS)
def attribute_task(cfg: dict[str, Any], iteration: int, rollouts: str, checkpoint: str):
    return _finish(phases.attribute(_cfg(cfg), iteration, Path(rollouts), Path(checkpoint)))


@task(name="reward", **TASK_OPTIONS)
def reward_task(cfg: dict[str, Any], iteration: int, rollouts: str, sa_pairs: str):
    return _finish(phases.reward(_cfg(cfg), iteration, Path(rollouts), Path(sa_pairs)))


@task(name="value", **TASK_OPTIONS)
def value_task(cfg: dict[str, Any], iteration: int, rollouts: str, checkpoint: str):
    return _finish(phases.value(_cfg(cfg), iteration, Path(rollouts), Path(checkpoint)))


@task(name="advantage", **TASK_OPTIONS)
def advantage_task(cfg: dict[str, Any], iteration: int, rewards: str, values: str):
    return _finish(phases.advantage(_cfg(cfg), iteration, Path(rewards), Path(values)))


@task(name="train", **TASK_OPTIONS)
def train_task(cfg: dict[str, Any], iteration: int, rollouts: str, sa_pairs: str, advantages: str, checkpoint: str):
    return _finish(
        phases.train(_cfg(cfg), iteration, Path(rollouts), Path(sa_pairs), Path(advantages), Path(checkpoint))
    )


@task(name="evaluate", **TASK_OPTIONS)
def evaluate_task(cfg: dict[str, Any], iteration: int, checkpoint: str):
    return _finish(phases.evaluate(_cfg(cfg), iteration, Path(checkpoint)))
