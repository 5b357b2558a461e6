"""A registered policy as a model: load an MLflow model version onto the base model, generate with it.

A version of registered model ``ppo-<run>`` holds only the policy LoRA adapter
(see ``track.register_policy``); it needs the same base model and LoRA layout to
mean anything. MLflow stays in ``track``; this module joins what ``track``
downloads to ``ppo_core.models``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ppo_core import track
from ppo_core.config import PPOConfig, load_config
from ppo_core.models import POLICY, PolicyValueModel, load_policy_value_model


def run_config(run: str, artifact_root: Path | str | None = None, overrides: dict[str, Any] | None = None) -> PPOConfig:
    """The config run ``run`` was trained with (its pinned ``run.json``), read from ``artifact_root``.

    A run's LoRA layout and base model are fixed when it starts, so its own
    config is the one that loads its registered adapters. Without ``run.json``
    (another machine sharing the tracking server) the defaults plus
    ``overrides`` are used, and a mismatch is reported on load.
    """
    root = Path(artifact_root) if artifact_root is not None else PPOConfig.model_fields["artifact_root"].default
    pinned_path = root / f"run={run}" / "run.json"
    pinned = json.loads(pinned_path.read_text())["config"] if pinned_path.is_file() else {}
    # the pinned artifact_root may be stale (a moved folder); the one given here is where the run is now
    return load_config(overrides={**pinned, **(overrides or {}), "run": run, "artifact_root": str(root)})


def check_compatible(cfg: PPOConfig, version) -> None:
    """Refuse a registered version whose base model or LoRA layout differs from ``cfg``'s, naming each difference."""
    expected = track.policy_identity(cfg)
    wrong = {k: (version.tags.get(k), v) for k, v in expected.items() if version.tags.get(k) != v}
    if wrong:
        raise track.RegistryError(
            f"registered model '{version.name}' version {version.version} does not fit this config: "
            + ", ".join(f"{k} {got!r} (config: {want!r})" for k, (got, want) in sorted(wrong.items()))
            + f"; load it with the config of run '{version.tags.get(track.RUN_TAG)}' "
            "(ppo_core.registry.run_config)"
        )


def load_registered_policy(cfg: PPOConfig, version: int | str = "latest") -> PolicyValueModel:
    """The base model of ``cfg`` with the policy adapter of registered version ``version`` loaded.

    Generate with ``ppo_core.generate.generate(model, ..., adapter="policy")``.
    The model is the process-wide shared instance (one copy of the base
    weights), so a later load into its policy slot replaces this adapter.
    """
    with tempfile.TemporaryDirectory(prefix="ppo-policy-") as tmp:
        mv, adapter_file = track.download_policy(cfg, version, Path(tmp))
        check_compatible(cfg, mv)  # before the base weights load
        model = load_policy_value_model(cfg)
        model.load_adapter(POLICY, adapter_file)
    return model


def generate_text(
    model: PolicyValueModel, prompts: list[str], *, max_new_tokens: int = 40, temperature: float = 0.0, seed: int = 0
) -> list[str]:
    """The policy's answers to ``prompts`` (each a user turn); ``temperature`` 0 is greedy."""
    from ppo_core.generate import decode_responses, generate, render_prompts

    gen = generate(
        model, render_prompts(model, prompts), adapter=POLICY,
        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
    )
    return decode_responses(model, gen.response_ids)
