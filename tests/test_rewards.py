"""Reward functions, score validation, KL shaping and the adaptive KL controller."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import numpy as np
import pytest

from ppo_core.rewards import (
    KeywordReward,
    LengthWindow,
    RewardError,
    VaderSentiment,
    adaptive_kl_coef,
    make_reward,
    score_responses,
    shape_rewards,
)


# --- shape_rewards ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kl_coef", [0.0, 0.05, 1.3])
def test_shape_rewards_per_rollout_sums(seed, kl_coef):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 15, size=int(rng.integers(1, 8)))
    kl = rng.normal(size=int(lengths.sum())).astype(np.float32)
    scores = rng.uniform(0.1, 2.0, size=len(lengths)) * rng.choice([-1, 1], size=len(lengths))
    score_t, penalty, reward = shape_rewards(kl, lengths, scores, kl_coef)

    assert score_t.shape == penalty.shape == reward.shape == kl.shape
    np.testing.assert_allclose(reward, score_t + penalty)
    np.testing.assert_allclose(penalty, -kl_coef * kl.astype(np.float64))
    start = 0
    for i, n in enumerate(lengths):
        seg = slice(start, start + n)
        # per-rollout sum of reward = score - kl_coef * sum(KL)
        assert reward[seg].sum() == pytest.approx(scores[i] - kl_coef * kl[seg].astype(np.float64).sum(), abs=1e-9)
        # score sits at the last token only
        assert score_t[start + n - 1] == pytest.approx(scores[i])
        assert np.all(score_t[start : start + n - 1] == 0.0)
        start += n
    assert np.count_nonzero(score_t) == len(lengths)


def test_shape_rewards_small_example():
    kl = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    score_t, penalty, reward = shape_rewards(kl, np.array([2, 3]), np.array([1.0, -1.0]), 0.5)
    np.testing.assert_allclose(score_t, [0.0, 1.0, 0.0, 0.0, -1.0])
    np.testing.assert_allclose(penalty, [-0.05, -0.1, -0.15, -0.2, -0.25])
    np.testing.assert_allclose(reward, [-0.05, 0.9, -0.15, -0.2, -1.25])


# --- reward functions ------------------------------------------------------


def test_vader_ranks_positive_above_negative():
    fn = VaderSentiment()
    responses = [
        "I absolutely love this, it is wonderful and makes me so happy!",
        "This is terrible, awful and I hate it. Worst day ever.",
        "The table is made of wood.",
    ]
    s = fn(["p"] * 3, responses, np.array([10, 10, 5]))
    assert s.shape == (3,) and s.dtype == np.float64
    assert s[0] > 0.5
    assert s[1] < -0.5
    assert s[0] > s[2] > s[1]
    assert np.all((s >= -1.0) & (s <= 1.0))


def test_length_window_inside_and_outside():
    fn = LengthWindow(lo=8, hi=24)
    n = np.array([0, 4, 8, 16, 24, 36, 48, 60])
    s = fn([""] * len(n), [""] * len(n), n)
    np.testing.assert_allclose(s, [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    assert np.all((s >= 0) & (s <= 1))


def test_length_window_lo_zero():
    fn = LengthWindow(lo=0, hi=10)
    np.testing.assert_allclose(fn([""] * 3, [""] * 3, np.array([0, 10, 15])), [1.0, 1.0, 0.5])


def test_keyword_whole_word_case_insensitive():
    fn = KeywordReward(("cat", "dog"))
    responses = [
        "I have a Cat.",  # case-insensitive
        "DOG!",
        "concatenate strings",  # substring only: not a whole word
        "dogma and catalogue",
        "",
        "no pets here",
        "the cat",
    ]
    s = fn([""] * len(responses), responses, np.ones(len(responses)))
    np.testing.assert_array_equal(s, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert s.dtype == np.float64


def test_make_reward_specs():
    assert isinstance(make_reward("vader", 8, 24), VaderSentiment)
    length = make_reward("length", length_min=3, length_max=7)
    assert isinstance(length, LengthWindow) and (length.lo, length.hi) == (3, 7)
    kw = make_reward("keyword:happy,joy", 8, 24)
    assert isinstance(kw, KeywordReward) and kw.keywords == ("happy", "joy")


@pytest.mark.parametrize("spec", ["nope", "", "Vader", "keywords:x", "model:/some/path"])
def test_make_reward_rejects_unknown(spec):
    with pytest.raises(RewardError):
        make_reward(spec, 8, 24)


# --- score_responses ---------------------------------------------------------


class _Fn:
    def __init__(self, name, body):
        self.name = name
        self._body = body

    def __call__(self, prompts, responses, n_tokens):
        return self._body(prompts, responses, n_tokens)


def _boom(p, r, n):
    raise ValueError("kaput")


ARGS = (["p1", "p2", "p3"], ["a", "b", "c"], np.array([1, 2, 3]))


def test_score_responses_ok():
    fn = _Fn("good", lambda p, r, n: [0.1, 0.2, 0.3])
    out = score_responses(fn, *ARGS)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, [0.1, 0.2, 0.3])


@pytest.mark.parametrize(
    "body",
    [
        _boom,
        lambda p, r, n: np.array([0.1, np.nan, 0.3]),
        lambda p, r, n: np.array([0.1, np.inf, 0.3]),
        lambda p, r, n: np.array([0.1, 0.2]),
        lambda p, r, n: np.ones((3, 1)),
        lambda p, r, n: 1.0,
        lambda p, r, n: ["x", "y", "z"],
    ],
    ids=["raises", "nan", "inf", "short", "2d", "scalar", "strings"],
)
def test_score_responses_errors_name_function(body):
    fn = _Fn("my_reward_fn", body)
    with pytest.raises(RewardError, match="my_reward_fn"):
        score_responses(fn, *ARGS)


def test_score_responses_error_mentions_cause():
    with pytest.raises(RewardError, match="kaput") as info:
        score_responses(_Fn("f", _boom), *ARGS)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RewardError, match="rollout 1"):
        score_responses(_Fn("f", lambda p, r, n: [0.0, np.nan, np.nan]), *ARGS)


# --- adaptive KL ------------------------------------------------------------


def test_adaptive_kl_raises_when_above_target():
    new = adaptive_kl_coef(0.1, mean_kl=8.0, target=4.0, n_rollouts=32, horizon=10000)
    assert new > 0.1
    # proportional error is clipped to +0.2
    assert new == pytest.approx(0.1 * (1 + 0.2 * 32 / 10000))


def test_adaptive_kl_lowers_when_below_target():
    new = adaptive_kl_coef(0.1, mean_kl=3.0, target=4.0, n_rollouts=32, horizon=10000)
    assert 0 < new < 0.1
    assert new == pytest.approx(0.1 * (1 - 0.2 * 32 / 10000))
    # a small error is not clipped
    assert adaptive_kl_coef(0.1, 4.2, 4.0, 100, 100) == pytest.approx(0.1 * 1.05)


def test_adaptive_kl_unchanged_at_target():
    assert adaptive_kl_coef(0.3, mean_kl=4.0, target=4.0, n_rollouts=32, horizon=100) == pytest.approx(0.3)
