"""GAE against a plain per-rollout Python reference, whitening, to_grid."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import numpy as np
import pytest

from ppo_core.advantage import gae, to_grid, whiten_array


def reference_gae(rewards, values, lengths, gamma, lam):
    """Per rollout, loop backwards; the state after the last token is terminal (V = 0)."""
    td, adv, ret = [], [], []
    start = 0
    for n in lengths:
        r = [float(x) for x in rewards[start : start + n]]
        v = [float(x) for x in values[start : start + n]]
        d_roll = [0.0] * n
        a_roll = [0.0] * n
        next_a = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            d_roll[t] = r[t] + gamma * next_v - v[t]
            next_a = d_roll[t] + gamma * lam * next_a
            a_roll[t] = next_a
        td.extend(d_roll)
        adv.extend(a_roll)
        ret.extend(a + b for a, b in zip(a_roll, v))
        start += n
    return np.array(td), np.array(adv), np.array(ret)


def random_batch(seed: int, n_rollouts: int | None = None):
    rng = np.random.default_rng(seed)
    b = int(n_rollouts if n_rollouts is not None else rng.integers(1, 9))
    lengths = rng.integers(1, 21, size=b)
    total = int(lengths.sum())
    rewards = rng.normal(size=total)
    values = rng.normal(size=total)
    return rewards, values, lengths


GAMMA_LAM = [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0), (0.99, 0.95), (0.5, 0.3), (1.0, 0.95), (0.9, 1.0)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_gae_matches_reference(seed, gamma, lam):
    rewards, values, lengths = random_batch(seed)
    td, adv, ret = reference_gae(rewards, values, lengths, gamma, lam)
    res = gae(rewards, values, lengths, gamma, lam, whiten=False)
    assert res.td_error.shape == res.advantage.shape == res.returns.shape == (int(lengths.sum()),)
    np.testing.assert_allclose(res.td_error, td, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(res.advantage, adv, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(res.returns, ret, rtol=1e-9, atol=1e-9)
    # whiten=False leaves the advantages unchanged (and is a copy, not an alias)
    np.testing.assert_array_equal(res.whitened, res.advantage)
    assert not np.shares_memory(res.whitened, res.advantage)


@pytest.mark.parametrize("seed", range(4))
def test_gae_random_gamma_lam(seed):
    rng = np.random.default_rng(100 + seed)
    gamma, lam = rng.uniform(0, 1, size=2)
    rewards, values, lengths = random_batch(200 + seed)
    _, adv, ret = reference_gae(rewards, values, lengths, gamma, lam)
    res = gae(rewards, values, lengths, gamma, lam, whiten=False)
    np.testing.assert_allclose(res.advantage, adv, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(res.returns, ret, rtol=1e-9, atol=1e-9)


def test_gae_single_token_rollouts():
    # each rollout is one token: A = r - V (terminal next state), returns = r
    rewards = np.array([1.0, -2.0, 0.5])
    values = np.array([0.25, 0.5, -1.0])
    res = gae(rewards, values, np.array([1, 1, 1]), gamma=0.9, lam=0.9, whiten=False)
    np.testing.assert_allclose(res.advantage, rewards - values)
    np.testing.assert_allclose(res.returns, rewards)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t within each rollout, no leakage across rollouts
    rewards = np.array([1.0, 2.0, 3.0, 10.0, 20.0])
    values = np.array([0.5, 0.0, 1.0, 2.0, 0.0])
    res = gae(rewards, values, np.array([3, 2]), gamma=1.0, lam=1.0, whiten=False)
    np.testing.assert_allclose(res.returns, [6.0, 5.0, 3.0, 30.0, 20.0])
    np.testing.assert_allclose(res.advantage, np.array([6.0, 5.0, 3.0, 30.0, 20.0]) - values)


@pytest.mark.parametrize("seed", range(5))
def test_gae_whitened(seed):
    rewards, values, lengths = random_batch(seed, n_rollouts=6)
    raw = gae(rewards, values, lengths, 0.99, 0.95, whiten=False)
    res = gae(rewards, values, lengths, 0.99, 0.95, whiten=True)
    # whitening does not change the raw advantages or returns
    np.testing.assert_allclose(res.advantage, raw.advantage)
    np.testing.assert_allclose(res.returns, raw.returns)
    assert abs(res.whitened.mean()) < 1e-9
    assert res.whitened.std() == pytest.approx(1.0, abs=1e-6)
    # whitening is an affine map with positive slope of the advantages
    expected = (raw.advantage - raw.advantage.mean()) / raw.advantage.std()
    np.testing.assert_allclose(res.whitened, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(res.whitened, res.advantage)


def test_whiten_array_edge_cases():
    np.testing.assert_array_equal(whiten_array(np.array([3.0])), [0.0])
    assert whiten_array(np.array([])).size == 0
    out = whiten_array(np.array([2.0, 2.0, 2.0]))  # zero variance: finite, centred
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_to_grid_round_trip(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 21, size=int(rng.integers(1, 9)))
    flat = rng.normal(size=int(lengths.sum()))
    grid, mask = to_grid(flat, lengths)
    assert grid.shape == mask.shape == (len(lengths), int(lengths.max()))
    assert mask.dtype == bool
    np.testing.assert_array_equal(mask.sum(axis=1), lengths)
    # round trip: masked rows read back in rollout-major order
    np.testing.assert_array_equal(grid[mask], flat)
    # each row holds its rollout's tokens left-aligned, zero padded
    start = 0
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(grid[i, :n], flat[start : start + n])
        assert np.all(grid[i, n:] == 0.0)
        assert mask[i, :n].all() and not mask[i, n:].any()
        start += n


def test_to_grid_empty():
    grid, mask = to_grid(np.array([]), np.array([], dtype=int))
    assert grid.shape == (0, 0) and mask.shape == (0, 0)
