"""Minibatch PPO epochs over one iteration's tables; adapters checkpointed per iteration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ppo_core.advantage import to_grid
from ppo_core.faults import failpoint
from ppo_core.losses import policy_loss, value_loss
from ppo_core.models import PPO_ADAPTERS, POLICY, VALUE, PolicyValueModel
from ppo_core.score import make_batch, token_logprobs, token_values
from ppo_core.tables import atomic_path


TRUNK_CHUNK = 16  # rows per pass when precomputing frozen-layer activations


class TrainingError(RuntimeError):
    """Training diverged (non-finite loss or gradient); the checkpoint was not advanced."""


@dataclass
class TrainData:
    """Everything one PPO update reads, rollout-major, flat over tokens."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprob: np.ndarray
    old_value: np.ndarray
    advantage: np.ndarray  # the one the loss uses (whitened or not, per config)
    returns: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.response_ids])


@dataclass
class TrainSettings:
    epochs: int
    num_minibatches: int
    policy_lr: float
    value_lr: float
    clip_range: float
    value_clip_range: float
    entropy_coef: float
    max_grad_norm: float
    temperature: float


# Optimiser trees are keyed by '/'-joined paths so that tree_flatten/unflatten
# (which split on '.') round-trip them through a safetensors file unchanged.
def _slash(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k.replace(".", "/"): v for k, v in flat.items()}


def _dot(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k.replace("/", "."): v for k, v in flat.items()}


def make_optimizer(lr: float) -> optim.Optimizer:
    return optim.Adam(learning_rate=lr)


def save_optimizer(opt: optim.Optimizer, path: Path) -> None:
    with atomic_path(path) as tmp:
        mx.save_safetensors(str(tmp), dict(tree_flatten(opt.state)))


def load_optimizer(opt: optim.Optimizer, path: Path) -> None:
    opt.state = tree_unflatten(list(mx.load(str(path)).items()))


def checkpoint_paths(ckpt_dir: Path) -> dict[str, Path]:
    paths = {}
    for a in PPO_ADAPTERS:
        paths[f"{a}_adapter"] = ckpt_dir / f"{a}_adapter.safetensors"
        paths[f"{a}_optimizer"] = ckpt_dir / f"{a}_optimizer.safetensors"
    return paths


def _grid(flat: np.ndarray, lengths: np.ndarray) -> mx.array:
    return mx.array(to_grid(flat, lengths)[0].astype(np.float32))


def _finite(name: str, value: mx.array, where: str) -> None:
    if not bool(mx.isfinite(value).all()):
        raise TrainingError(f"non-finite {name} at {where}; the iteration fails and the checkpoint is not advanced")


def ppo_update(
    model: PolicyValueModel,
    data: TrainData,
    settings: TrainSettings,
    optimizers: dict[str, optim.Optimizer],
    rng: np.random.Generator,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Run the PPO epochs; returns one metrics row per optimiser step."""
    n = len(data.response_ids)
    starts = np.concatenate([[0], np.cumsum(data.lengths)])

    def rows(idx: np.ndarray, flat: np.ndarray) -> np.ndarray:
        return np.concatenate([flat[starts[i] : starts[i + 1]] for i in idx])

    # The frozen lower layers see the same tokens in every epoch and for both
    # adapters: run them once for the whole batch, then train only the top.
    full = make_batch(data.prompt_ids, data.response_ids, model.pad_token_id)
    trunks = []
    for lo in range(0, n, TRUNK_CHUNK):
        t = model.trunk(full.tokens[lo : lo + TRUNK_CHUNK])
        mx.eval(t)
        trunks.append(t)
    trunk_all = mx.concatenate(trunks, axis=0)

    def policy_objective(params, batch, trunk, old_lp, adv):
        model.assign(_dot(params))
        # entropy is a training signal only with a bonus; attribute reports it otherwise
        lp, ent = token_logprobs(model, batch, POLICY, settings.temperature, trunk, settings.entropy_coef > 0)
        loss, stats = policy_loss(lp, old_lp, adv, batch.mask, settings.clip_range, ent, settings.entropy_coef)
        return loss, stats

    def value_objective(params, batch, trunk, old_v, ret):
        model.assign(_dot(params))
        v = token_values(model, batch, VALUE, trunk)
        return value_loss(v, old_v, ret, batch.mask, settings.value_clip_range)

    policy_vg = mx.value_and_grad(policy_objective)
    value_vg = mx.value_and_grad(value_objective)
    params = {a: _slash(model.trainable(a)) for a in PPO_ADAPTERS}

    def update(adapter, value_and_grad, loss_name, old, target, batch, trunk, idx, lens, where):
        """One clipped-gradient optimiser step of ``adapter``; fails loudly on non-finite numbers."""
        (_, stats), grads = value_and_grad(
            params[adapter], batch, trunk, _grid(rows(idx, old), lens), _grid(rows(idx, target), lens)
        )
        grads, norm = optim.clip_grad_norm(grads, settings.max_grad_norm)
        mx.eval(stats, norm)
        _finite(f"{adapter} loss", stats[loss_name], where)
        _finite(f"{adapter} gradient norm", norm, where)
        params[adapter] = optimizers[adapter].apply_gradients(grads, params[adapter])
        return stats, norm
    metrics: list[dict[str, float]] = []
    step = 0
    for epoch in range(settings.epochs):
        for mb, idx in enumerate(np.array_split(rng.permutation(n), settings.num_minibatches)):
            idx = np.sort(idx)
            lens = data.lengths[idx]
            batch = make_batch([data.prompt_ids[i] for i in idx], [data.response_ids[i] for i in idx], model.pad_token_id)
            trunk = trunk_all[mx.array(idx)][:, : batch.tokens.shape[1]]
            where = f"epoch {epoch} minibatch {mb}"

            mb_args = (batch, trunk, idx, lens, where)
            p_stats, p_norm = update(POLICY, policy_vg, "policy_loss", data.old_logprob, data.advantage, *mb_args)
            v_stats, v_norm = update(VALUE, value_vg, "value_loss", data.old_value, data.returns, *mb_args)
            mx.eval(params)

            row = {"step": step, "epoch": epoch, "minibatch": mb}
            row.update({k: float(v.item()) for k, v in {**p_stats, **v_stats}.items()})
            row.update({"policy_grad_norm": float(p_norm.item()), "value_grad_norm": float(v_norm.item())})
            metrics.append(row)
            if on_step:
                on_step(row)
            step += 1
            failpoint("train.step")
    for a in PPO_ADAPTERS:
        model.assign(_dot(params[a]))
    return metrics
