"""The order of one PPO iteration's phases, independent of who runs them.

``run_iteration`` takes a ``call(phase, fn, *args)`` adaptor: the Prefect flow
passes one that runs each phase as a task; ``run`` (below) calls the phase
functions directly, for notebooks and scripts without Prefect.
"""

from __future__ import annotations

from typing import Any, Callable

from ppo_core import phases, runs
from ppo_core.config import PPOConfig
from ppo_core.phases import checkpoint_dir

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
