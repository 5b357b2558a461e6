"""Minibatch PPO epochs over one iteration's tables.

``ppo_update`` shuffles the rollouts into minibatches each epoch; ``PPOStep``
takes one clipped-gradient optimiser step of each trained adapter (policy and
value; the policy alone with a critic-free estimator; the value alone during
value warm-up) per ``Minibatch``, in the spirit of mlx-lm's ``step(batch)``.

The optimisers are bias-corrected Adam with a warm-up/decay schedule of the
optimiser's own step count, which is saved with its moments in every
checkpoint: the schedule and the moments carry across iterations, as in one
long training run.

Data-parallel: given an ``mx.distributed`` group of N ranks, each rank takes
its contiguous slice of every minibatch; token means are taken over the whole
minibatch's tokens, so summing the ranks' gradients (one ``all_sum`` of all of
them, flattened) gives the minibatch's gradient, clipped by its global norm.
Every rank then takes the same optimiser step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ppo_core import progress
from ppo_core.advantage import to_grid
from ppo_core.config import PPOConfig
from ppo_core.faults import failpoint
from ppo_core.losses import policy_loss, value_loss
from ppo_core.models import PPO_ADAPTERS, POLICY, VALUE, PolicyValueModel
from ppo_core.score import TRUNKS, Batch, flat_hidden, flat_to_grid, make_batch, token_values, trunk_activations
from ppo_core.vocab_head import token_stats
from ppo_core.tables import atomic_path


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


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    num_minibatches: int
    clip_range: float
    value_clip_range: float
    entropy_coef: float
    max_grad_norm: float
    temperature: float
    adapters: tuple[str, ...] = PPO_ADAPTERS  # the adapters this update trains

    @classmethod
    def from_config(cls, cfg: PPOConfig, adapters: tuple[str, ...] = PPO_ADAPTERS) -> TrainSettings:
        return cls(
            epochs=cfg.ppo_epochs, num_minibatches=cfg.num_minibatches, clip_range=cfg.clip_range,
            value_clip_range=cfg.value_clip_range, entropy_coef=cfg.entropy_coef,
            max_grad_norm=cfg.max_grad_norm, temperature=cfg.temperature, adapters=adapters,
        )


@dataclass
class Minibatch:
    """Some rollouts of the batch, padded, with their per-token targets on the (B, T) grid."""

    batch: Batch
    trunk: mx.array  # frozen-layer activations of batch.tokens
    old_logprob: mx.array
    advantage: mx.array
    old_value: mx.array
    returns: mx.array
    where: str  # "epoch E minibatch M", for error messages
    denominator: mx.array | None = None  # tokens of the whole minibatch across ranks (None: this grid's)


# Optimiser trees are keyed by '/'-joined paths so that tree_flatten/unflatten
# (which split on '.') round-trip them through a safetensors file unchanged.
def _slash(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k.replace(".", "/"): v for k, v in flat.items()}


def _dot(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k.replace("/", "."): v for k, v in flat.items()}


def learning_rate_schedule(peak: float, cfg: PPOConfig) -> float | Callable[[mx.array], mx.array]:
    """The config's schedule of one optimiser's learning rate, as a function of its step (a constant when flat)."""
    if cfg.lr_schedule == "constant" and cfg.lr_warmup_steps == 0:
        return peak
    floor, decay = peak * cfg.lr_min_ratio, cfg.lr_decay_iterations * cfg.steps_per_iteration
    after = {
        "constant": lambda step: mx.array(peak, dtype=mx.float32),
        "linear": optim.linear_schedule(peak, floor, decay),
        "cosine": optim.cosine_decay(peak, decay, floor),
    }[cfg.lr_schedule]
    warm = cfg.lr_warmup_steps
    if warm <= 1:
        return after
    # step s < warm runs at peak x (s + 1) / warm: the first step already moves, the last warm-up step is at the peak
    return optim.join_schedules([optim.linear_schedule(peak / warm, peak, warm - 1), after], [warm])


def make_optimizer(lr: float | Callable[[mx.array], mx.array]) -> optim.Optimizer:
    # bias_correction: without it MLX's Adam moves the first hundreds of steps by up to ~6x the learning rate
    return optim.Adam(learning_rate=lr, bias_correction=True)


def make_optimizers(cfg: PPOConfig) -> dict[str, optim.Optimizer]:
    return {
        POLICY: make_optimizer(learning_rate_schedule(cfg.policy_lr, cfg)),
        VALUE: make_optimizer(learning_rate_schedule(cfg.value_lr, cfg)),
    }


def save_optimizer(opt: optim.Optimizer, path: Path) -> None:
    with atomic_path(path) as tmp:
        mx.save_safetensors(str(tmp), dict(tree_flatten(opt.state)))


def load_optimizer(opt: optim.Optimizer, path: Path) -> None:
    try:
        state = mx.load(str(path))
    except Exception as exc:  # mx.load raises bare RuntimeError/ValueError on a damaged file
        raise TrainingError(f"cannot read optimiser state {path}: {exc}") from exc
    if "step" not in state:
        raise TrainingError(f"optimiser state {path} has no step counter: not an optimiser file of this project")
    opt.state = tree_unflatten(list(state.items()))


def _finite(name: str, value: mx.array, where: str) -> None:
    if not bool(mx.isfinite(value).all()):
        raise TrainingError(f"non-finite {name} at {where}; the iteration fails and the checkpoint is not advanced")


def all_sum_tree(tree, group: mx.distributed.Group):
    """Sum a tree of arrays over the ranks of ``group`` in one collective (the leaves flattened into one vector)."""
    flat = tree_flatten(tree)
    vector = mx.distributed.all_sum(mx.concatenate([v.reshape(-1) for _, v in flat]), group=group)
    out, start = [], 0
    for key, v in flat:
        out.append((key, vector[start : start + v.size].reshape(v.shape)))
        start += v.size
    return tree_unflatten(out)


class PPOStep:
    """One optimiser step of each adapter in ``settings.adapters`` per minibatch."""

    def __init__(
        self,
        model: PolicyValueModel,
        settings: TrainSettings,
        optimizers: dict[str, optim.Optimizer],
        group: mx.distributed.Group | None = None,
    ):
        self.model, self.settings, self.optimizers, self.group = model, settings, optimizers, group
        self.params = {a: _slash(model.trainable(a)) for a in settings.adapters}
        self._value_and_grad = {
            POLICY: mx.value_and_grad(self._policy_objective),
            VALUE: mx.value_and_grad(self._value_objective),
        }

    def _policy_objective(self, params, mb: Minibatch):
        """The PPO-clip loss of the policy adapter; the vocabulary head's gradient is ``token_stats``'s own VJP."""
        s, model, batch = self.settings, self.model, mb.batch
        model.assign(_dot(params))
        h = flat_hidden(model, batch, POLICY, mb.trunk)
        with_entropy = s.entropy_coef > 0  # entropy is a training signal only with a bonus; attribute reports it
        logprob, entropy = token_stats(model, h, batch.flat_targets, s.temperature, entropy=with_entropy)
        return policy_loss(
            flat_to_grid(logprob, batch), mb.old_logprob, mb.advantage, batch.mask, s.clip_range,
            flat_to_grid(entropy, batch) if with_entropy else None, s.entropy_coef, mb.denominator,
        )

    def _value_objective(self, params, mb: Minibatch):
        self.model.assign(_dot(params))
        v = token_values(self.model, mb.batch, VALUE, mb.trunk)
        return value_loss(v, mb.old_value, mb.returns, mb.batch.mask, self.settings.value_clip_range, mb.denominator)

    def gradient(self, adapter: str, mb: Minibatch) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """``adapter``'s loss statistics and gradient on ``mb`` (this rank's share, before any all_sum)."""
        (_, stats), grads = self._value_and_grad[adapter](self.params[adapter], mb)
        return stats, grads

    def _update(self, adapter: str, loss_name: str, mb: Minibatch) -> tuple[dict[str, mx.array], mx.array]:
        """One clipped-gradient step of ``adapter``; fails loudly on non-finite numbers."""
        stats, grads = self.gradient(adapter, mb)
        if self.group is not None:  # this rank's share of the minibatch's means: the sums are the minibatch's
            grads, stats = all_sum_tree(grads, self.group), all_sum_tree(stats, self.group)
        grads, norm = optim.clip_grad_norm(grads, self.settings.max_grad_norm)
        mx.eval(stats, norm)
        _finite(f"{adapter} loss", stats[loss_name], mb.where)
        _finite(f"{adapter} gradient norm", norm, mb.where)
        self.params[adapter] = self.optimizers[adapter].apply_gradients(grads, self.params[adapter])
        return stats, norm

    def __call__(self, mb: Minibatch) -> dict[str, float]:
        """Step the trained adapters on ``mb``; returns the step's metrics (of those adapters only)."""
        row: dict[str, float] = {}
        for adapter in self.settings.adapters:
            stats, norm = self._update(adapter, f"{adapter}_loss", mb)
            row.update({k: float(v.item()) for k, v in stats.items()})
            row[f"{adapter}_grad_norm"] = float(norm.item())
        mx.eval(self.params)
        return row

    def finish(self) -> None:
        """Leave the trained parameters in the model."""
        for a in self.settings.adapters:
            self.model.assign(_dot(self.params[a]))


def _shared_trunk(model: PolicyValueModel, tokens: mx.array, group: mx.distributed.Group) -> mx.array:
    """The whole batch's trunk activations, each rank computing an equal share and all_gather joining them.

    Every rank needs every row (minibatches are reshuffled each epoch), but
    none has to compute more than its share: the frozen pass then shrinks with
    the number of ranks, like the rest of training.
    """
    n, world = tokens.shape[0], group.size()
    per = -(-n // world)
    mine = tokens[group.rank() * per : (group.rank() + 1) * per]
    part = trunk_activations(model, mine) if mine.shape[0] else None
    hidden = model.backbone.embed_tokens.weight.shape[1]
    pad = per - (mine.shape[0] if part is not None else 0)
    pieces = ([part] if part is not None else []) + ([mx.zeros((pad, tokens.shape[1], hidden))] if pad else [])
    gathered = mx.distributed.all_gather(mx.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0], group=group)
    mx.eval(gathered)
    return gathered[:n]


def ppo_update(
    model: PolicyValueModel,
    data: TrainData,
    settings: TrainSettings,
    optimizers: dict[str, optim.Optimizer],
    rng: np.random.Generator,
    group: mx.distributed.Group | None = None,
) -> list[dict[str, float]]:
    """Run the PPO epochs; returns one metrics row per optimiser step (the same on every rank)."""
    n = len(data.response_ids)
    world, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    lengths = data.lengths
    starts = np.concatenate([[0], np.cumsum(lengths)])

    def grid(flat: np.ndarray, idx: np.ndarray) -> mx.array:
        rows = np.concatenate([flat[starts[i] : starts[i + 1]] for i in idx])
        return mx.array(to_grid(rows, lengths[idx])[0].astype(np.float32))

    # The frozen lower layers see the same tokens in every epoch and for both
    # adapters: run them once for the whole batch (or reuse the scoring phases'
    # pass over the same rollouts), then train only the top.
    tokens = make_batch(data.prompt_ids, data.response_ids, model.pad_token_id).tokens
    trunk_all = TRUNKS.get(model, tokens) if group is None else _shared_trunk(model, tokens, group)
    step = PPOStep(model, settings, optimizers, group)
    metrics: list[dict[str, float]] = []
    steps = settings.epochs * settings.num_minibatches
    with progress.report("training", steps, "steps") if rank == 0 else contextlib.nullcontext():
        for epoch in range(settings.epochs):
            for mb, idx in enumerate(np.array_split(rng.permutation(n), settings.num_minibatches)):
                idx = np.sort(idx)
                denominator = None
                if group is not None:
                    denominator = mx.array(float(max(lengths[idx].sum(), 1)))
                    idx = idx[len(idx) * rank // world : len(idx) * (rank + 1) // world]
                batch = make_batch([data.prompt_ids[i] for i in idx], [data.response_ids[i] for i in idx], model.pad_token_id)
                minibatch = Minibatch(
                    batch=batch,
                    trunk=trunk_all[mx.array(idx)][:, : batch.tokens.shape[1]],
                    old_logprob=grid(data.old_logprob, idx),
                    advantage=grid(data.advantage, idx),
                    old_value=grid(data.old_value, idx),
                    returns=grid(data.returns, idx),
                    where=f"epoch {epoch} minibatch {mb}",
                    denominator=denominator,
                )
                metrics.append({"step": len(metrics), "epoch": epoch, "minibatch": mb, **step(minibatch)})
                failpoint("train.step")
                progress.advance()
    step.finish()
    return metrics
