"""The critic-free estimators against an independent, loop-by-loop computation, and in the pipeline."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from safetensors.numpy import load_file

from ppo_core import pipeline
from ppo_core.advantage import critic_free
from ppo_core.config import ConfigError, load_config
from ppo_core.query import connect
from ppo_core.report import build_report
from ppo_core.tables import read_table

K = 4


def _batch(seed: int = 0, groups: int = 5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, groups * K)
    rewards = rng.normal(size=int(lengths.sum())) * 0.1
    rewards[np.cumsum(lengths) - 1] += rng.normal(size=len(lengths))  # the score at each last token
    return rewards, lengths


def _per_rollout(rewards, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(list(rewards[start : start + n]))
        start += n
    return out


def _expected(estimator, rewards, lengths, gamma=1.0, kl_penalty=None):
    if estimator == "grpo" and kl_penalty is not None:  # the group sees the scores; the penalty adds its reward-to-go
        scored = _expected("grpo", rewards - kl_penalty, lengths)
        to_go = []
        for row in _per_rollout(kl_penalty, lengths):
            to_go += [sum(row[t:]) for t in range(len(row))]
        return scored + np.array(to_go)
    rows = _per_rollout(rewards, lengths)
    if estimator == "reinforce_pp":
        returns = []
        for r in rows:
            g, acc = [], 0.0
            for x in reversed(r):
                acc = x + gamma * acc
                g.append(acc)
            returns += list(reversed(g))
        return np.array(returns)
    totals = [sum(r) for r in rows]
    adv = []
    for i, total in enumerate(totals):
        group = totals[(i // K) * K : (i // K + 1) * K]
        mean = sum(group) / K
        if estimator == "grpo":
            std = (sum((x - mean) ** 2 for x in group) / (K - 1)) ** 0.5
            a = (total - mean) / (std + 1e-4)
        elif estimator == "dr_grpo":
            a = total - mean
        else:  # rloo
            a = total - (sum(group) - total) / (K - 1)
        adv += [a] * len(rows[i])
    return np.array(adv)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_estimator_matches_an_independent_computation(estimator):
    rewards, lengths = _batch()
    res = critic_free(estimator, rewards, lengths, K, gamma=0.9 if estimator == "reinforce_pp" else 1.0, whiten=False)
    expected = _expected(estimator, rewards, lengths, gamma=0.9 if estimator == "reinforce_pp" else 1.0)
    np.testing.assert_allclose(res.advantage, expected, rtol=1e-9, atol=1e-12)
    if estimator == "reinforce_pp":  # the batch-normalised return is the estimator, whitening on or off
        np.testing.assert_allclose(res.whitened, (expected - expected.mean()) / (expected.std() + 1e-8), atol=1e-9)
    else:
        np.testing.assert_allclose(res.whitened, expected, atol=1e-12)
    np.testing.assert_allclose(res.td_error, rewards)  # r_t + gamma * 0 - 0: no value model


def test_grpo_keeps_kl_noise_out_of_its_normalisation():
    """Tied scores: the advantage is the KL penalty's reward-to-go, not KL noise divided by a tiny std."""
    lengths = np.array([3, 2, 4, 3])
    kl_penalty = -0.05 * np.array([0.1, 0.2, 0.0, 0.3, 0.1, 0.05, 0.0, 0.2, 0.1, 0.4, 0.0, 0.1])
    rewards = kl_penalty.copy()
    rewards[np.cumsum(lengths) - 1] += 1.0  # every response scores 1
    res = critic_free("grpo", rewards, lengths, 4, 1.0, False, kl_penalty=kl_penalty)
    to_go = np.concatenate([np.cumsum(x[::-1])[::-1] for x in np.split(kl_penalty, np.cumsum(lengths)[:-1])])
    np.testing.assert_allclose(res.advantage, to_go, atol=1e-12)
    assert np.abs(res.advantage).max() < 0.05


def test_advantage_phase_refuses_rollouts_out_of_order(tiny_cfg):
    from ppo_core import phases as P
    from ppo_core.tables import write_table

    cfg = tiny_cfg(advantage_estimator="rloo", samples_per_prompt=2)
    path = write_table(cfg.layout.iter_dir(1), "rewards", {
        "rollout_id": np.array([1, 1, 0], dtype=np.int32), "t": np.array([0, 1, 0], dtype=np.int32),
        "score": np.zeros(3), "kl_penalty": np.zeros(3), "reward": np.zeros(3),
    })  # fmt: skip
    with pytest.raises(ValueError, match=r"do not hold rollouts 0..1 in order"):
        P.advantage(cfg, 1, path, None)


def test_group_estimators_centre_each_group():
    rewards, lengths = _batch(1)
    for estimator in ("grpo", "dr_grpo", "rloo"):
        per_rollout = critic_free(estimator, rewards, lengths, K, 1.0, False).advantage[np.cumsum(lengths) - 1]
        np.testing.assert_allclose(per_rollout.reshape(-1, K).sum(axis=1), 0.0, atol=1e-9)


def test_rloo_whitening_follows_the_config_and_grpo_ignores_it():
    rewards, lengths = _batch(2)
    rloo = critic_free("rloo", rewards, lengths, K, 1.0, whiten=True)
    assert abs(rloo.whitened.mean()) < 1e-9 and abs(rloo.whitened.std() - 1) < 1e-6
    grpo = critic_free("grpo", rewards, lengths, K, 1.0, whiten=True)
    np.testing.assert_array_equal(grpo.whitened, grpo.advantage)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"advantage_estimator": "grpo"}, "samples_per_prompt must be >= 2"),
        ({"advantage_estimator": "rloo", "samples_per_prompt": 1}, "samples_per_prompt must be >= 2"),
        ({"advantage_estimator": "reinforce_pp", "value_warmup_iterations": 2}, "needs a value model"),
        ({"batch_size": 2, "samples_per_prompt": 2, "num_minibatches": 5}, r"batch_size x samples_per_prompt = 4"),
        ({"advantage_estimator": "ppo"}, "advantage_estimator"),
    ],
)
def test_estimator_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_grpo_iteration_samples_groups_and_trains_no_value_model(tiny_cfg, vowel_reward):
    cfg = tiny_cfg(
        advantage_estimator="grpo", batch_size=3, samples_per_prompt=K, reward=vowel_reward,
        max_new_tokens=6, num_minibatches=3, temperature=1.5,
    )
    pipeline.run(cfg, 2)
    con = connect(cfg.artifact_root)
    groups = con.sql(
        "SELECT iter, prompt_id, list(rollout_id ORDER BY rollout_id) AS ids, count(DISTINCT seed) AS seeds "
        "FROM rollouts GROUP BY ALL ORDER BY iter, ids"
    ).pl()
    assert groups.height == 2 * 3
    for ids, seeds in zip(groups["ids"].to_list(), groups["seeds"].to_list()):
        assert ids == list(range(ids[0], ids[0] + K)) and ids[0] % K == 0 and seeds == K
    assert not any(cfg.layout.iter_dir(it).joinpath("values.parquet").exists() for it in (1, 2))
    # the advantages are GRPO's of the stored rewards, recomputed here
    for it in (1, 2):
        rw = pl.from_arrow(read_table(cfg.layout.table(it, "rewards")))
        ad = pl.from_arrow(read_table(cfg.layout.table(it, "advantages")))
        lengths = rw.group_by("rollout_id", maintain_order=True).len()["len"].to_numpy()
        expected = _expected("grpo", rw["reward"].to_numpy().astype(np.float64), lengths,
                             kl_penalty=rw["kl_penalty"].to_numpy().astype(np.float64))
        np.testing.assert_allclose(ad["advantage"], expected, atol=1e-4)
        assert (ad["value"] == 0).all()
    # the value adapter is carried over untouched; the policy moved
    first, last = (cfg.layout.checkpoint(i) for i in (0, 2))
    for name, a in load_file(first.adapter("value")).items():
        np.testing.assert_array_equal(a, load_file(last.adapter("value"))[name])
    assert any(np.abs(a - load_file(last.adapter("policy"))[n]).max() > 0 for n, a in load_file(first.adapter("policy")).items())
    metrics = con.sql("SELECT count(*) FILTER (value_loss IS NOT NULL), count(policy_loss) FROM metrics").fetchall()[0]
    assert metrics == (0, 2 * cfg.steps_per_iteration)
    report = build_report(cfg.artifact_root, cfg.run).read_text()  # no value model: its charts are empty, not broken
    assert "Value loss" in report and "iteration 2" in report.lower()
