"""A registered policy as an ``mlx_lm`` adapter folder, or fused into a standalone model folder.

The policy LoRA here is ``y = W x + (alpha / rank) * (x @ a) @ b`` on the last
``lora_layers`` layers, which is mlx-lm's ``LoRALinear`` with ``lora_a = a``,
``lora_b = b`` and ``scale = alpha / rank``: exporting renames the arrays and
writes mlx-lm's ``adapter_config.json``. ``mlx_lm.generate --model BASE
--adapter-path OUT`` then samples what ``ppo generate`` does. ``fuse`` folds
the adapter into the base weights with mlx-lm's own ``LoRALinear.fuse`` and
saves a model folder that needs neither this project nor an adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from ppo_core import registry
from ppo_core.config import PPOConfig
from ppo_core.models import POLICY, resolve_model_dir

ADAPTER_FILE, ADAPTER_CONFIG = "adapters.safetensors", "adapter_config.json"
_MARKER = f".adapters.{POLICY}."


class ExportError(RuntimeError):
    """The output folder cannot be written, or the adapter does not map onto mlx-lm's layout."""


@dataclass(frozen=True)
class Exported:
    path: Path
    base_model: Path  # what --model must name for an adapter folder (the fused folder is self-contained)
    version: int
    iteration: str


def mlx_lm_arrays(policy: dict[str, mx.array]) -> dict[str, mx.array]:
    """Our policy adapter's arrays under mlx-lm's names (``...q_proj.adapters.policy.a`` -> ``...q_proj.lora_a``)."""
    out = {}
    for key, value in policy.items():
        module, marker, leaf = key.partition(_MARKER)
        if not marker or leaf not in ("a", "b"):
            raise ExportError(f"adapter array {key!r} is not a LoRA matrix of the policy")
        out[f"{module}.lora_{leaf}"] = value
    return out


def adapter_config(cfg: PPOConfig, arrays: dict[str, mx.array]) -> dict:
    """mlx-lm's adapter_config.json: LoRA on the last ``lora_layers`` layers, at the module paths the arrays name."""
    # "model.layers.29.self_attn.q_proj.lora_a" -> "self_attn.q_proj", relative to its layer as mlx-lm expects
    keys = sorted({".".join(k.split(".")[3:-1]) for k in arrays})
    return {
        "fine_tune_type": "lora",
        "num_layers": cfg.lora_layers,
        "lora_parameters": {"rank": cfg.lora_rank, "scale": cfg.lora_alpha / cfg.lora_rank, "dropout": 0.0, "keys": keys},
    }


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A sibling temporary folder that becomes ``out`` when the block succeeds: ``out`` appears whole or not at all."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder: choose a new output folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise ExportError(f"cannot write to {out.parent}: {exc.strerror}") from None
    try:
        yield staging
        os.replace(staging, out)  # rename(2) may replace an empty folder
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_adapter(cfg: PPOConfig, version: int | str, out: Path) -> Exported:
    """Write registered ``version``'s policy of run ``cfg.run`` as an mlx-lm adapter folder ``out``."""
    out = Path(out)
    with _staged(out) as staging, tempfile.TemporaryDirectory(prefix="ppo-export-") as tmp:
        mv, adapter_file = registry.download_policy(cfg, version, Path(tmp))
        registry.check_compatible(cfg, mv)  # the run's own layout is what adapter_config.json declares
        arrays = mlx_lm_arrays(mx.load(str(adapter_file)))
        mx.save_safetensors(str(staging / ADAPTER_FILE), arrays, metadata={"ppo.run": cfg.run, "ppo.version": str(mv.version)})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, arrays), indent=2) + "\n")
    return Exported(out, resolve_model_dir(cfg.model, cfg.artifact_root), int(mv.version), mv.tags.get("iteration", "?"))


def export_fused(cfg: PPOConfig, version: int | str, out: Path) -> Exported:
    """Write registered ``version``'s policy of run ``cfg.run`` fused into the base weights, as a model folder ``out``."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load, save

    out = Path(out)
    with _staged(out) as staging, tempfile.TemporaryDirectory(prefix="ppo-export-") as tmp:
        adapter = export_adapter(cfg, version, Path(tmp) / "adapter")
        model, tokenizer, config = load(str(adapter.base_model), adapter_path=str(adapter.path), return_config=True)
        fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
        model.update_modules(tree_unflatten(fused))
        save(staging, str(adapter.base_model), model, tokenizer, config, donate_model=False)
    return Exported(out, out, adapter.version, adapter.iteration)
