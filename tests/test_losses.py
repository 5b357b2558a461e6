"""PPO-clip policy and value losses against a numpy re-computation."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import numpy as np
import pytest

from ppo_core.losses import masked_mean, policy_loss, value_loss


def make_inputs(seed: int, B: int = 5, T: int = 9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0] = T  # at least one full row
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    old = rng.normal(-2.0, 1.0, size=(B, T)).astype(np.float32)
    new = (old + rng.normal(0.0, 0.4, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    ent = rng.uniform(0.0, 3.0, size=(B, T)).astype(np.float32)
    value = rng.normal(size=(B, T)).astype(np.float32)
    old_value = (value + rng.normal(0.0, 0.4, size=(B, T))).astype(np.float32)
    returns = rng.normal(size=(B, T)).astype(np.float32)
    return dict(mask=mask, old=old, new=new, adv=adv, ent=ent, value=value, old_value=old_value, returns=returns)


def np_policy(new, old, adv, mask, clip, ent=None, ent_coef=0.0):
    m = mask.astype(np.float64) > 0
    ratio = np.exp(new.astype(np.float64) - old)
    pg_tok = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip, 1 + clip))
    pg = pg_tok[m].mean()
    entropy = ent[m].mean() if ent is not None else 0.0
    log_ratio = (new.astype(np.float64) - old)[m]
    approx_kl = (ratio[m] - 1 - log_ratio).mean()
    clip_frac = (np.abs(ratio[m] - 1) > clip).mean()
    return pg - ent_coef * entropy, pg, entropy, approx_kl, clip_frac


def np_value(value, old_value, returns, mask, clip):
    m = mask > 0
    v = value.astype(np.float64)
    vc = old_value + np.clip(v - old_value, -clip, clip)
    loss = 0.5 * np.maximum((v - returns) ** 2, (vc - returns) ** 2)[m].mean()
    frac = (np.abs(v - old_value) > clip)[m].mean()
    return loss, frac


def f(x: mx.array) -> float:
    return float(x.item())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("clip", [0.05, 0.2, 0.5])
def test_policy_loss_matches_numpy(seed, clip):
    d = make_inputs(seed)
    loss, stats = policy_loss(
        mx.array(d["new"]), mx.array(d["old"]), mx.array(d["adv"]), mx.array(d["mask"]), clip,
        entropy=mx.array(d["ent"]), entropy_coef=0.01,
    )
    exp_loss, exp_pg, exp_ent, exp_kl, exp_cf = np_policy(
        d["new"], d["old"], d["adv"], d["mask"], clip, d["ent"], 0.01
    )
    assert f(loss) == pytest.approx(exp_loss, rel=1e-4, abs=1e-5)
    assert f(stats["policy_loss"]) == pytest.approx(exp_pg, rel=1e-4, abs=1e-5)
    assert f(stats["entropy"]) == pytest.approx(exp_ent, rel=1e-4, abs=1e-5)
    assert f(stats["approx_kl"]) == pytest.approx(exp_kl, rel=1e-3, abs=1e-5)
    assert f(stats["clip_fraction"]) == pytest.approx(exp_cf, abs=1e-6)


def test_policy_loss_without_entropy():
    d = make_inputs(11)
    loss, stats = policy_loss(mx.array(d["new"]), mx.array(d["old"]), mx.array(d["adv"]), mx.array(d["mask"]), 0.2)
    exp_loss, exp_pg, *_ = np_policy(d["new"], d["old"], d["adv"], d["mask"], 0.2)
    assert f(loss) == pytest.approx(exp_loss, rel=1e-4, abs=1e-5)
    assert f(stats["policy_loss"]) == pytest.approx(exp_pg, rel=1e-4, abs=1e-5)
    assert np.isnan(f(stats["entropy"]))  # not computed: reported as NaN, never as a fake 0


def test_policy_loss_clip_examples():
    # one token per case, mask all ones; clip 0.2
    lr = np.log(np.array([[1.5, 1.5, 0.5, 0.5, 1.1, 1.0]], dtype=np.float32))
    adv = np.array([[1.0, -1.0, 1.0, -1.0, 2.0, -3.0]], dtype=np.float32)
    mask = np.ones_like(adv)
    _, stats = policy_loss(mx.array(lr), mx.zeros_like(mx.array(lr)), mx.array(adv), mx.array(mask), 0.2)
    # per token: A>0,r=1.5 -> -1.2 (clipped); A<0,r=1.5 -> +1.5; A>0,r=0.5 -> -0.5; A<0,r=0.5 -> +0.8 (clipped);
    # r=1.1 -> -2.2 ; r=1 -> +3
    expected = np.mean([-1.2, 1.5, -0.5, 0.8, -2.2, 3.0])
    assert f(stats["policy_loss"]) == pytest.approx(expected, rel=1e-5)
    assert f(stats["clip_fraction"]) == pytest.approx(4 / 6)


@pytest.mark.parametrize("seed", range(4))
def test_policy_loss_ignores_padding(seed):
    d = make_inputs(seed)
    args = [d["new"], d["old"], d["adv"], d["ent"]]
    loss, stats = policy_loss(
        *map(mx.array, args[:3]), mx.array(d["mask"]), 0.2, entropy=mx.array(args[3]), entropy_coef=0.1
    )
    assert (d["mask"] == 0).any()
    rng = np.random.default_rng(1000 + seed)
    pad = d["mask"] == 0
    changed = []
    for a in args:
        a = a.copy()
        a[pad] = rng.uniform(-5, 5, size=pad.sum()).astype(np.float32)
        changed.append(a)
    loss2, stats2 = policy_loss(
        *map(mx.array, changed[:3]), mx.array(d["mask"]), 0.2, entropy=mx.array(changed[3]), entropy_coef=0.1
    )
    assert f(loss2) == pytest.approx(f(loss), rel=1e-6, abs=1e-7)
    for k in stats:
        assert f(stats2[k]) == pytest.approx(f(stats[k]), rel=1e-6, abs=1e-7), k


def test_clip_fraction_counts_ratio_outside_band():
    ratios = np.array([[1.0, 1.19, 1.21, 0.81, 0.79, 2.0, 0.1, 3.0]], dtype=np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=np.float32)  # 3.0 is padding
    adv = np.ones_like(ratios)
    _, stats = policy_loss(mx.array(np.log(ratios)), mx.zeros(ratios.shape), mx.array(adv), mx.array(mask), 0.2)
    # outside |r-1| > 0.2 among the 7 real tokens: 1.21, 0.79, 2.0, 0.1
    assert f(stats["clip_fraction"]) == pytest.approx(4 / 7, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_approx_kl_nonnegative_and_zero_on_policy(seed):
    d = make_inputs(seed)
    mask = mx.array(d["mask"])
    _, stats = policy_loss(mx.array(d["new"]), mx.array(d["old"]), mx.array(d["adv"]), mask, 0.2)
    assert f(stats["approx_kl"]) > 0.0
    _, stats = policy_loss(mx.array(d["old"]), mx.array(d["old"]), mx.array(d["adv"]), mask, 0.2)
    assert f(stats["approx_kl"]) == 0.0
    assert f(stats["clip_fraction"]) == 0.0
    # on policy (ratio == 1) the surrogate is just -mean(advantage)
    m = d["mask"] > 0
    assert f(stats["policy_loss"]) == pytest.approx(-d["adv"][m].mean(), rel=1e-5, abs=1e-6)


def test_approx_kl_nonnegative_for_large_ratios():
    lr = np.array([[-3.0, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0]], dtype=np.float32)
    for sign in (1, -1):
        _, stats = policy_loss(mx.array(sign * lr), mx.zeros(lr.shape), mx.ones(lr.shape), mx.ones(lr.shape), 0.2)
        assert f(stats["approx_kl"]) >= 0.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("clip", [0.1, 0.2, 1.0])
def test_value_loss_matches_numpy(seed, clip):
    d = make_inputs(seed)
    loss, stats = value_loss(
        mx.array(d["value"]), mx.array(d["old_value"]), mx.array(d["returns"]), mx.array(d["mask"]), clip
    )
    exp_loss, exp_frac = np_value(d["value"], d["old_value"], d["returns"], d["mask"], clip)
    assert f(loss) == pytest.approx(exp_loss, rel=1e-4, abs=1e-6)
    assert f(stats["value_loss"]) == pytest.approx(exp_loss, rel=1e-4, abs=1e-6)
    assert f(stats["value_clip_fraction"]) == pytest.approx(exp_frac, abs=1e-6)


def test_value_loss_clip_example():
    # v_old = 0, v = 1, R = 1, clip 0.2: unclipped err 0, clipped v = 0.2 -> err 0.64 -> max -> 0.5*0.64
    one = lambda x: mx.array([[x]], dtype=mx.float32)  # noqa: E731
    loss, stats = value_loss(one(1.0), one(0.0), one(1.0), one(1.0), 0.2)
    assert f(loss) == pytest.approx(0.32, rel=1e-5)
    assert f(stats["value_clip_fraction"]) == 1.0
    # inside the band: plain 0.5 * (v - R)^2
    loss, stats = value_loss(one(0.1), one(0.0), one(1.0), one(1.0), 0.2)
    assert f(loss) == pytest.approx(0.5 * 0.81, rel=1e-5)
    assert f(stats["value_clip_fraction"]) == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_value_loss_ignores_padding(seed):
    d = make_inputs(seed)
    args = [d["value"], d["old_value"], d["returns"]]
    loss, stats = value_loss(*map(mx.array, args), mx.array(d["mask"]), 0.2)
    pad = d["mask"] == 0
    assert pad.any()
    rng = np.random.default_rng(2000 + seed)
    changed = []
    for a in args:
        a = a.copy()
        a[pad] = rng.uniform(-50, 50, size=pad.sum()).astype(np.float32)
        changed.append(a)
    loss2, stats2 = value_loss(*map(mx.array, changed), mx.array(d["mask"]), 0.2)
    assert f(loss2) == pytest.approx(f(loss), rel=1e-6, abs=1e-7)
    assert f(stats2["value_clip_fraction"]) == pytest.approx(f(stats["value_clip_fraction"]), abs=1e-7)


def test_masked_mean_all_masked_is_zero_not_nan():
    out = masked_mean(mx.array([[1.0, 2.0]]), mx.zeros((1, 2)))
    assert f(out) == 0.0
    assert f(masked_mean(mx.array([[1.0, 3.0, 100.0]]), mx.array([[1.0, 1.0, 0.0]]))) == pytest.approx(2.0)
