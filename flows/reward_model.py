"""Flow `reward-model`: train a learned reward model on preference pairs (Bradley-Terry)."""

from __future__ import annotations

from typing import Any

from flows import _env  # noqa: F401
import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ppo_core import track
from ppo_core.config import PROJECT_ROOT, load_config
from ppo_core.reward_model import load_preferences

DEFAULT_DATA = str(PROJECT_ROOT / "data" / "preferences.jsonl")


@task(name="train-reward-model", cache_policy=NO_CACHE, persist_result=False)
def train_reward_model_task(cfg: dict[str, Any], data: str, name: str, epochs: int, lr: float, eval_fraction: float) -> dict:
    from ppo_core.config import PPOConfig
    from ppo_core.reward_model import train_from_file

    log = get_run_logger()
    return train_from_file(
        PPOConfig(**cfg), data, name, epochs=epochs, lr=lr, eval_fraction=eval_fraction,
        on_epoch=lambda r: log.info("epoch %d: loss %.4f  train acc %.3f  held-out acc %.3f",
                                    r["epoch"], r["loss"], r["train_accuracy"], r["eval_accuracy"]),
    )


@flow(name="reward-model", log_prints=True)
def reward_model(
    name: str = "rm",
    data: str = DEFAULT_DATA,
    epochs: int = 2,
    lr: float = 1e-3,
    eval_fraction: float = 0.2,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``<artifact_root>/reward_models/<name>.safetensors``; use it with ``reward=model:<path>``."""
    cfg = load_config(overrides=overrides or {})
    load_preferences(data)  # fail before a model loads
    result = train_reward_model_task(cfg.to_json_dict(), data, name, epochs, lr, eval_fraction)
    track.log_reward_model(cfg, name, {"data": data, "epochs": epochs, "lr": lr, "eval_fraction": eval_fraction}, result)
    return result
