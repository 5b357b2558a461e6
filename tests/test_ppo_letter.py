"""PPO to the letter: the optimiser, the KL controller, the reward phase and the update's direction.

Each test here fails on a specific wrong implementation: Adam without bias
correction, a KL controller counting tokens, a reward that counts EOS or
skips the missing-EOS penalty, training at another temperature than scoring,
an update that follows the negated advantage.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file

from ppo_core import phases as P
from ppo_core import pipeline
from ppo_core.config import ConfigError, load_config
from ppo_core.generate import render_prompts
from ppo_core.layout import Checkpoint
from ppo_core.losses import value_loss
from ppo_core.models import POLICY, VALUE, load_policy_value_model
from ppo_core.query import connect
from ppo_core.score import make_batch, score_logprobs, token_values
from ppo_core.tables import read_table, write_table
from ppo_core.train import TrainData, TrainSettings, learning_rate_schedule, make_optimizers, ppo_update


def _adapter_change(cfg, adapter: str, a: int, b: int) -> float:
    before, after = (load_file(cfg.layout.checkpoint(i).adapter(adapter)) for i in (a, b))
    return max(float(np.abs(after[k] - v).max()) for k, v in before.items())


# ---------------------------------------------------------------- optimiser


def test_first_adam_step_moves_no_parameter_by_more_than_the_learning_rate(tiny_cfg, vowel_reward):
    """Bias-corrected Adam's first step is lr x g/|g| per parameter; uncorrected MLX Adam moves 3.16x lr."""
    cfg = tiny_cfg(reward=vowel_reward, ppo_epochs=1, num_minibatches=1, policy_lr=1e-3, value_lr=2e-3, temperature=1.5)
    pipeline.run(cfg, 1)
    for adapter, lr in ((POLICY, cfg.policy_lr), (VALUE, cfg.value_lr)):
        assert lr * 0.98 <= _adapter_change(cfg, adapter, 0, 1) <= lr * 1.0001


def test_learning_rate_schedule_warms_up_then_decays_to_the_floor():
    cfg = load_config(None, {"lr_schedule": "linear", "lr_warmup_steps": 4, "lr_decay_iterations": 2,
                             "ppo_epochs": 2, "num_minibatches": 2, "policy_lr": 1e-3, "lr_min_ratio": 0.1})
    rate = learning_rate_schedule(cfg.policy_lr, cfg)
    at = lambda step: float(rate(mx.array(step)))  # noqa: E731
    assert [at(s) for s in (0, 2, 3, 4)] == pytest.approx([2.5e-4, 7.5e-4, 1e-3, 1e-3])
    decay = 2 * cfg.steps_per_iteration  # 8 steps after the warm-up
    assert at(4 + decay // 2) == pytest.approx(1e-3 - 0.5 * 0.9e-3)
    assert at(4 + decay) == pytest.approx(1e-4) and at(4 + 10 * decay) == pytest.approx(1e-4)
    cosine = learning_rate_schedule(1e-3, cfg.model_copy(update={"lr_schedule": "cosine", "lr_warmup_steps": 0}))
    assert float(cosine(mx.array(decay // 2))) == pytest.approx(1e-4 + 0.5 * 0.9e-3, rel=1e-5)
    assert learning_rate_schedule(1e-3, load_config(None, {})) == 1e-3  # constant: a plain float


def test_the_schedule_and_adam_moments_carry_across_iterations(tiny_cfg, vowel_reward, tmp_path):
    cfg = tiny_cfg(reward=vowel_reward, lr_schedule="linear", lr_warmup_steps=3, lr_decay_iterations=1, temperature=1.5)
    pipeline.run(cfg, 2)
    state = load_file(cfg.layout.checkpoint(2).optimizer(POLICY))
    steps = 2 * cfg.steps_per_iteration
    assert int(state["step"]) == steps
    rate = learning_rate_schedule(cfg.policy_lr, cfg)
    assert float(state["learning_rate"]) == pytest.approx(float(rate(mx.array(steps - 1))))
    # iteration 2 resumed iteration 1's moments: the same step from fresh moments ends elsewhere
    bare = Checkpoint(tmp_path / "without-optimiser")
    shutil.copytree(cfg.layout.checkpoint(1).dir, bare.dir)
    for a in (POLICY, VALUE):
        bare.optimizer(a).unlink()
    fresh = cfg.model_copy(update={"run": "fresh-moments"})
    P.train(fresh, 2, *(cfg.layout.table(2, t) for t in ("rollouts", "sa_pairs", "advantages")), bare)
    other = load_file(fresh.layout.checkpoint(2).optimizer(POLICY))
    moments = [k for k in state if k not in ("step", "learning_rate")]
    assert moments and int(other["step"]) == cfg.steps_per_iteration
    assert any(np.abs(other[k] - state[k]).max() > 1e-9 for k in moments)


def test_value_warmup_trains_only_the_value_model_first(tiny_cfg, vowel_reward):
    cfg = tiny_cfg(reward=vowel_reward, value_warmup_iterations=1, temperature=1.5)
    pipeline.run(cfg, 2)
    assert _adapter_change(cfg, POLICY, 0, 1) == 0.0 and _adapter_change(cfg, VALUE, 0, 1) > 0
    assert _adapter_change(cfg, POLICY, 1, 2) > 0
    # the policy's optimiser did not step (nor its schedule advance) during the warm-up
    steps = {i: int(load_file(cfg.layout.checkpoint(i).optimizer(POLICY))["step"]) for i in (1, 2)}
    assert steps == {1: 0, 2: cfg.steps_per_iteration}
    per_iter = connect(cfg.artifact_root).sql(
        "SELECT iter, count(policy_loss), count(value_loss) FROM metrics GROUP BY iter ORDER BY iter"
    ).fetchall()
    assert per_iter == [(1, 0, cfg.steps_per_iteration), (2, cfg.steps_per_iteration, cfg.steps_per_iteration)]


# ---------------------------------------------------------------- KL controller


def test_adaptive_kl_counts_rollouts_not_tokens(tiny_cfg):
    """kl_coef(i) = kl_coef(i-1) x (1 + clip(KL/target - 1, +-0.2) x rollouts / kl_horizon), KL per rollout."""
    cfg = tiny_cfg(adaptive_kl=True, kl_coef=0.1, kl_target=0.05, kl_horizon=30, temperature=1.5, policy_lr=3e-3,
                   reward="length", length_min=1, length_max=3)
    pipeline.run(cfg, 3)
    con = connect(cfg.artifact_root)
    kl = dict(con.sql("SELECT iter, sum(kl) / count(DISTINCT rollout_id) FROM sa_pairs GROUP BY iter").fetchall())
    rollouts = dict(con.sql("SELECT iter, count(*) FROM rollouts GROUP BY iter").fetchall())
    tokens = dict(con.sql("SELECT iter, count(*) FROM sa_pairs GROUP BY iter").fetchall())
    coef = {i: float(pq.read_schema(cfg.layout.table(i, "rewards")).metadata[b"kl_coef"]) for i in (1, 2, 3)}
    assert coef[1] == cfg.kl_coef
    for i in (2, 3):
        error = np.clip(kl[i - 1] / cfg.kl_target - 1, -0.2, 0.2)
        assert coef[i] == pytest.approx(coef[i - 1] * (1 + error * rollouts[i - 1] / cfg.kl_horizon), rel=1e-6)
        assert tokens[i - 1] > rollouts[i - 1]  # the test tells the two units apart


# ---------------------------------------------------------------- reward phase


def test_reward_phase_scores_length_without_eos_and_applies_the_missing_eos_penalty(tiny_cfg):
    """Against the raw rule, recomputed here: EOS is not a word, a cut response pays the penalty."""
    cfg = tiny_cfg(reward="length", length_min=3, length_max=4, missing_eos_penalty=-0.25, kl_coef=0.5)
    it_dir = cfg.layout.iter_dir(1)
    eos = 7
    responses = [[5, 6, eos], [5, 6, 8, 9], [5, 6, 8, 9, eos], [5, 6, 8, 9, 10, 11, 12, 13, 14, 15]]
    finish = ["eos", "length", "eos", "length"]
    ro = write_table(it_dir, "rollouts", {
        "rollout_id": np.arange(4, dtype=np.int32), "prompt_id": [f"p{i}" for i in range(4)], "prompt": ["q"] * 4,
        "response": ["r"] * 4, "prompt_token_ids": [[1, 2]] * 4, "response_token_ids": responses,
        "finish_reason": finish, "sampling_logprobs": [[-1.0] * len(r) for r in responses], "seed": np.arange(4),
    })  # fmt: skip
    rid = np.repeat(np.arange(4), [len(r) for r in responses]).astype(np.int32)
    t = np.concatenate([np.arange(len(r)) for r in responses]).astype(np.int32)
    kl = np.linspace(-0.1, 0.3, len(rid)).astype(np.float32)
    sa = write_table(it_dir, "sa_pairs", {
        "rollout_id": rid, "t": t, "token_id": np.concatenate(responses).astype(np.int32), "token": ["x"] * len(rid),
        "logprob": kl, "ref_logprob": np.zeros_like(kl), "kl": kl, "entropy": np.ones_like(kl),
    })  # fmt: skip
    P.reward(cfg, 1, ro, sa)
    rw = pl.from_arrow(read_table(cfg.layout.table(1, "rewards")))
    words = [2, 4, 4, 10]  # generated tokens, EOS not counted
    window = [2 / 3, 1.0, 1.0, 0.0]  # 1 inside [3, 4], linear to 0 at 0 tokens and at 2 x 4 (and 0 beyond)
    expected = np.array(window) + np.array([0, -0.25, 0, -0.25])
    last = rw.group_by("rollout_id").agg(pl.col("score").last()).sort("rollout_id")["score"].to_numpy()
    np.testing.assert_allclose(last, expected, atol=1e-6)
    assert words == [len(r) - (f == "eos") for r, f in zip(responses, finish)]
    np.testing.assert_allclose(rw["kl_penalty"], -0.5 * kl, atol=1e-7)
    np.testing.assert_allclose(rw["reward"], rw["score"] + rw["kl_penalty"], atol=1e-6)


# ---------------------------------------------------------------- training


def test_training_uses_the_sampling_temperature(tiny_cfg):
    """With T != 1 the first step's ratio is exactly 1: attribute and train score at the same temperature."""
    cfg = tiny_cfg(temperature=0.6, ppo_epochs=1, num_minibatches=1)
    pipeline.run(cfg, 1)
    first = pl.from_arrow(read_table(cfg.layout.table(1, "metrics"))).row(0, named=True)
    assert abs(first["approx_kl"]) < 1e-6 and first["clip_fraction"] == 0.0
    sampled = np.concatenate(read_table(cfg.layout.table(1, "rollouts")).column("sampling_logprobs").to_pylist())
    np.testing.assert_allclose(read_table(cfg.layout.table(1, "sa_pairs")).column("logprob").to_numpy(), sampled, atol=1e-4)


def test_entropy_bonus_and_unwhitened_advantages(tiny_cfg, vowel_reward):
    cfg = tiny_cfg(reward=vowel_reward, entropy_coef=0.05, whiten_advantages=False, temperature=1.5)
    results = pipeline.run(cfg, 1)[1]
    train = next(r for r in results if r["phase"] == "train")
    assert np.isfinite(train["stats"]["entropy"]) and train["stats"]["entropy"] > 0
    ad = pl.from_arrow(read_table(cfg.layout.table(1, "advantages")))
    np.testing.assert_array_equal(ad["whitened_advantage"], ad["advantage"])
    assert abs(ad["advantage"].mean()) > 1e-6  # not whitened to mean 0


def _update_once(model, prompts, responses, advantage_sign: np.ndarray, cfg):
    """One PPO step on given advantages (+1 / -1 per rollout); returns (logprob before, after) per rollout."""
    [(old_lp, _)] = score_logprobs(model, prompts, responses, adapters=(POLICY,), temperature=1.0, batch_size=8, entropy=(False,))
    lengths = np.array([len(r) for r in responses])
    batch = make_batch(prompts, responses, model.pad_token_id)
    old_v = np.concatenate([np.array(token_values(model, batch, VALUE))[i, :n] for i, n in enumerate(lengths)])
    returns = old_v + np.repeat(advantage_sign, lengths)  # a value target above V where the advantage is positive
    data = TrainData(prompts, responses, old_lp, old_v, np.repeat(advantage_sign, lengths).astype(np.float64), returns)
    settings = TrainSettings.from_config(cfg)
    v_before, _ = value_loss(token_values(model, batch, VALUE), *(mx.array(_grid(x, lengths)) for x in (old_v, returns)),
                             batch.mask, cfg.value_clip_range)
    ppo_update(model, data, settings, make_optimizers(cfg), np.random.default_rng(0))
    [(new_lp, _)] = score_logprobs(model, prompts, responses, adapters=(POLICY,), temperature=1.0, batch_size=8, entropy=(False,))
    v_after, _ = value_loss(token_values(model, batch, VALUE), *(mx.array(_grid(x, lengths)) for x in (old_v, returns)),
                            batch.mask, cfg.value_clip_range)
    split = np.cumsum(lengths)[:-1]
    per_rollout = lambda lp: np.array([x.sum() for x in np.split(lp, split)])  # noqa: E731
    return per_rollout(old_lp), per_rollout(new_lp), float(v_before), float(v_after)


def _grid(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    from ppo_core.advantage import to_grid

    return to_grid(flat, lengths)[0].astype(np.float32)


def test_one_update_follows_the_advantage_and_lowers_the_value_loss(tiny_cfg):
    cfg = tiny_cfg(ppo_epochs=1, num_minibatches=1, policy_lr=5e-3, value_lr=5e-3, run="direction")
    P.init_checkpoint(cfg)
    model = P.model_for(cfg, cfg.layout.checkpoint(0))
    prompts = render_prompts(model, ["Tell me about rivers.", "Say something nice.", "What is rain?", "Hello"])
    rng = np.random.default_rng(1)
    responses = [rng.integers(10, 300, n).tolist() for n in (4, 6, 3, 5)]
    sign = np.array([1.0, -1.0, 1.0, -1.0])
    before, after, v_before, v_after = _update_once(model, prompts, responses, sign, cfg)
    assert (np.sign(after - before) == sign).all(), (before, after)
    assert v_after < v_before


def test_top_p_below_one_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"top_p < 1 is refused: .*off-policy"):
        load_config(None, {"top_p": 0.9})
