"""Prefect task: train a learned reward model (Bradley-Terry) and return its JSON summary."""

from __future__ import annotations

from typing import Any

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ppo_core.config import PPOConfig, RewardModelSettings
from ppo_core.reward_model import train_from_file


@task(name="train-reward-model", cache_policy=NO_CACHE, persist_result=False)
def train_reward_model(cfg: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Train and save the reward model; per-epoch loss and accuracies go to the task's log."""
    log = get_run_logger()
    return train_from_file(
        PPOConfig(**cfg), RewardModelSettings(**settings),
        on_epoch=lambda r: log.info("epoch %d: loss %.4f  train acc %.3f  held-out acc %.3f",
                                    r["epoch"], r["loss"], r["train_accuracy"], r["eval_accuracy"]),
    )
