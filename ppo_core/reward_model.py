"""Learned reward model: base + reward LoRA + scalar head, trained with Bradley-Terry.

The reward of a (prompt, response) pair is the head's output on the final
hidden state of ``chat(prompt) + response``: in training, the preference
text encoded and closed with EOS; in PPO, exactly the tokens the policy
generated (EOS included only if it emitted one, so a response cut at the
length limit is scored as cut). Training minimises
``-log sigmoid(r(chosen) - r(rejected))`` over preference pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import polars as pl

from ppo_core.config import RewardModelSettings
from ppo_core.generate import render_prompts
from ppo_core.layout import reward_model_path, reward_model_sidecar
from ppo_core.models import REWARD, ModelError, PolicyValueModel, load_policy_value_model
from ppo_core.score import TRUNK_CHUNK, make_batch, trunk_activations
from ppo_core.tables import atomic_write_text

NORMALIZATIONS = ("none", "batch", "train")
MAX_PREFERENCES_BYTES = 1 << 30


class PreferenceError(ValueError):
    """The preference file is missing or malformed."""


def load_preferences(path: Path) -> pl.DataFrame:
    """Columns prompt, chosen, rejected (JSONL or Parquet)."""
    path = Path(path)
    if not path.is_file():
        raise PreferenceError(f"preference file {path} does not exist")
    if path.stat().st_size > MAX_PREFERENCES_BYTES:
        raise PreferenceError(
            f"preference file {path} is larger than {MAX_PREFERENCES_BYTES >> 20} MB: it is read (and trained on) whole"
        )
    try:
        df = pl.read_parquet(path) if path.suffix == ".parquet" else pl.read_ndjson(path)
    except Exception as exc:
        raise PreferenceError(f"preference file {path} is unreadable: {exc}") from None
    missing = [c for c in ("prompt", "chosen", "rejected") if c not in df.columns]
    if missing:
        raise PreferenceError(f"preference file {path} lacks column(s) {missing}")
    if df.height < 2:
        raise PreferenceError(f"preference file {path} needs at least 2 pairs (has {df.height})")
    return df.select(pl.col("prompt", "chosen", "rejected").cast(pl.String))


def split_pairs(df: pl.DataFrame, eval_fraction: float, seed: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Held-out pairs are split by prompt, so no prompt is in both halves."""
    prompts = df["prompt"].unique().sort()
    order = np.random.default_rng(seed).permutation(len(prompts))
    n_eval = max(1, int(round(len(prompts) * eval_fraction)))
    held = set(prompts.gather(order[:n_eval]).to_list())
    mask = df["prompt"].is_in(list(held))
    return df.filter(~mask), df.filter(mask)


def _sequences(model: PolicyValueModel, prompts: list[str], responses: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    eos = model.eos_token_ids[0]
    resp = [model.tokenizer.encode(r, add_special_tokens=False) + [eos] for r in responses]
    return render_prompts(model, prompts), resp


def _last_position_rewards(model: PolicyValueModel, batch, trunk: mx.array, lengths: mx.array) -> mx.array:
    h = model.top(trunk, REWARD)
    last = mx.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0, :]
    return model.reward_from_hidden(last)


def score_texts(model: PolicyValueModel, prompts: list[str], responses: list[str], batch_size: int) -> np.ndarray:
    """Reward-model score of each (prompt, complete response), in batches."""
    return score_ids(model, *_sequences(model, prompts, responses), batch_size)


def score_ids(model: PolicyValueModel, p_ids: list[list[int]], r_ids: list[list[int]], batch_size: int) -> np.ndarray:
    """Reward-model score of each tokenised (prompt, response), in batches."""
    out = []
    for lo in range(0, len(p_ids), batch_size):
        b = make_batch(p_ids[lo : lo + batch_size], r_ids[lo : lo + batch_size], model.pad_token_id)
        lengths = mx.array([len(p) + len(r) for p, r in zip(p_ids[lo : lo + batch_size], r_ids[lo : lo + batch_size])])
        r = _last_position_rewards(model, b, model.trunk(b.tokens), lengths)
        mx.eval(r)
        out.append(np.array(r))
    return np.concatenate(out).astype(np.float64)


@dataclass
class RewardModelResult:
    train_accuracy: float
    eval_accuracy: float
    score_mean: float
    score_std: float
    history: list[dict[str, float]]


def train_reward_model(
    model: PolicyValueModel,
    train: pl.DataFrame,
    held_out: pl.DataFrame,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    score_batch_size: int,
    seed: int,
    on_epoch: Callable[[dict[str, float]], None] | None = None,
) -> RewardModelResult:
    """Bradley-Terry training of the reward adapter + head; reports held-out pairwise accuracy."""
    model.reset_adapters(seed, (REWARD,))
    # chosen and rejected of pair i are rows i and n + i: one trunk pass for both
    n = train.height
    p_ids, r_ids = _sequences(model, train["prompt"].to_list() * 2, train["chosen"].to_list() + train["rejected"].to_list())
    full = make_batch(p_ids, r_ids, model.pad_token_id)
    trunk_all = trunk_activations(model, full.tokens)
    lengths_all = mx.array([len(p) + len(r) for p, r in zip(p_ids, r_ids)])

    def loss_fn(params, idx):
        model.assign(params)
        rows = mx.concatenate([idx, idx + n])
        r = _last_position_rewards(model, full, trunk_all[rows], lengths_all[rows])
        margin = r[: idx.shape[0]] - r[idx.shape[0] :]
        return -mx.mean(mx.log(mx.sigmoid(margin) + 1e-12)), margin

    vg = mx.value_and_grad(loss_fn)
    opt = optim.Adam(learning_rate=lr, bias_correction=True)
    params = model.trainable(REWARD)
    rng = np.random.default_rng(seed)
    history = []
    for epoch in range(epochs):
        losses, correct = [], 0
        for chunk in np.array_split(rng.permutation(n), max(1, n // batch_size)):
            (loss, margin), grads = vg(params, mx.array(chunk))
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            params = opt.apply_gradients(grads, params)
            mx.eval(params, loss, margin)
            if not np.isfinite(loss.item()):
                raise FloatingPointError(f"non-finite reward-model loss in epoch {epoch}")
            losses.append(loss.item())
            correct += int((np.array(margin) > 0).sum())
        model.assign(params)
        row = {"epoch": epoch, "loss": float(np.mean(losses)), "train_accuracy": correct / n,
               "eval_accuracy": pairwise_accuracy(model, held_out, score_batch_size)}
        history.append(row)
        if on_epoch:
            on_epoch(row)
    # training-set score statistics (for reward_norm='train'), from the cached trunk
    scores = np.concatenate([
        np.array(_last_position_rewards(model, full, trunk_all[lo : lo + TRUNK_CHUNK], lengths_all[lo : lo + TRUNK_CHUNK]))
        for lo in range(0, 2 * n, TRUNK_CHUNK)
    ])
    return RewardModelResult(history[-1]["train_accuracy"], history[-1]["eval_accuracy"],
                             float(scores.mean()), float(scores.std() + 1e-8), history)


def pairwise_accuracy(model: PolicyValueModel, pairs: pl.DataFrame, batch_size: int) -> float:
    chosen = score_texts(model, pairs["prompt"].to_list(), pairs["chosen"].to_list(), batch_size)
    rejected = score_texts(model, pairs["prompt"].to_list(), pairs["rejected"].to_list(), batch_size)
    return float(np.mean(chosen > rejected))


def lora_layout(cfg_like) -> dict[str, str]:
    """The LoRA layout a reward-model file was trained with; PPO must match it to load it."""
    return {
        "lora_layers": str(cfg_like.lora_layers), "lora_rank": str(cfg_like.lora_rank),
        "lora_alpha": str(cfg_like.lora_alpha), "lora_targets": ",".join(cfg_like.lora_targets),
    }


def save_reward_model(model: PolicyValueModel, path: Path, cfg_like, result: RewardModelResult) -> Path:
    meta = {**lora_layout(cfg_like), "model_dir": model.model_dir.name, "score_mean": repr(result.score_mean),
            "score_std": repr(result.score_std), "eval_accuracy": repr(result.eval_accuracy)}
    model.save_adapter(REWARD, path, metadata=meta)
    atomic_write_text(reward_model_sidecar(path), json.dumps({**meta, "history": result.history}, indent=2))
    return path


class LearnedReward:
    """A trained reward model behind the RewardFunction interface (``reward=model:<path>``)."""

    name = "model"

    def __init__(self, model: PolicyValueModel, path: Path, cfg_like, normalize: str = "none"):
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"reward normalisation must be one of {NORMALIZATIONS}")
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"reward model file {path} does not exist")
        try:
            _, meta = mx.load(str(path), return_metadata=True)
        except Exception as exc:  # a damaged file: mx.load raises bare RuntimeError/ValueError
            raise ModelError(f"cannot read reward model file {path}: {exc}") from exc
        if meta.get("adapter") != REWARD:
            raise ModelError(f"{path} is not a reward-model file (adapter={meta.get('adapter')!r})")
        if meta.get("model_dir") not in (None, model.model_dir.name):
            raise ModelError(
                f"reward model {path} was trained on base model {meta['model_dir']!r}, "
                f"but this run uses {model.model_dir.name!r}; train one on this model with `ppo reward-model`"
            )
        expected = lora_layout(cfg_like)
        wrong = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
        if wrong:
            raise ModelError(
                f"reward model {path} was trained with a different LoRA layout: "
                + ", ".join(f"{k} {a} (run uses {b})" for k, (a, b) in wrong.items())
            )
        model.load_adapter(REWARD, path)
        self.model, self.normalize, self.batch_size = model, normalize, cfg_like.score_batch_size
        try:
            self.mean, self.std = float(meta["score_mean"]), float(meta["score_std"])
        except (KeyError, ValueError) as exc:
            raise ModelError(f"reward model file {path} lacks its score statistics ({exc}): retrain it with `ppo reward-model`") from None
        self.name = f"model:{path.name}"

    def __call__(self, prompts: list[str], responses: list[str], n_tokens: np.ndarray) -> np.ndarray:
        return self._normalized(score_texts(self.model, prompts, responses, self.batch_size))

    def score_token_ids(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> np.ndarray:
        """Score what the policy generated, token for token.

        A model with several end tokens may end with another than the one the
        reward model was trained to see after a complete response: that one
        takes its place.
        """
        trained_eos, eos = self.model.eos_token_ids[0], set(self.model.eos_token_ids)
        closed = [r[:-1] + [trained_eos] if r and r[-1] in eos else r for r in response_ids]
        return self._normalized(score_ids(self.model, prompt_ids, closed, self.batch_size))

    def _normalized(self, scores: np.ndarray) -> np.ndarray:
        if self.normalize == "train":
            return (scores - self.mean) / self.std
        if self.normalize == "batch":
            return (scores - scores.mean()) / (scores.std() + 1e-8)
        return scores


def train_from_file(
    cfg_like, settings: RewardModelSettings, on_epoch: Callable[[dict[str, float]], None] | None = None
) -> dict:
    """Load pairs, split by prompt, train, save to ``layout.reward_model_path(root, name)``."""
    pairs = load_preferences(settings.data)
    train, held = split_pairs(pairs, settings.eval_fraction, cfg_like.seed)
    model = load_policy_value_model(cfg_like)
    result = train_reward_model(model, train, held, epochs=settings.epochs, lr=settings.lr,
                                batch_size=settings.batch_size, score_batch_size=cfg_like.score_batch_size,
                                seed=cfg_like.seed, on_epoch=on_epoch)
    path = save_reward_model(model, reward_model_path(cfg_like.artifact_root, settings.name), cfg_like, result)
    return {"path": str(path), "train_pairs": train.height, "eval_pairs": held.height,
            "train_accuracy": result.train_accuracy, "eval_accuracy": result.eval_accuracy, "history": result.history}
