"""Flow `reward-model`: train a learned reward model on preference pairs (Bradley-Terry)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from ppo_core import track
from ppo_core.config import RewardModelSettings, load_config
from ppo_core.reward_model import load_preferences
from tasks.reward_model import train_reward_model


@flow(name="reward-model", log_prints=True, persist_result=False)
def reward_model(settings: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train and save a reward model under the artifact root; use it with ``reward=model:<path>``.

    ``settings`` holds ``RewardModelSettings`` fields (name, data, epochs, lr,
    batch_size, eval_fraction); ``overrides`` the PPOConfig fields that shape
    the model (model, lora_*, seed, artifact_root).
    """
    cfg = load_config(overrides=overrides or {})
    rm = RewardModelSettings.build(**(settings or {}))
    load_preferences(rm.data)  # fail before a model loads
    result = train_reward_model(cfg.to_json_dict(), rm.model_dump(mode="json"))
    track.log_reward_model(cfg, rm.name, rm.model_dump(mode="json", exclude={"name"}), result)
    return result
