"""PPO losses over padded (B, T) token grids with a 0/1 mask.

Every mean is over tokens. ``denominator`` is the number of tokens the mean
is over: by default this grid's own, and under data-parallel training the
whole minibatch's across ranks, so that the ranks' losses (and gradients) sum
to the minibatch's.
"""

from __future__ import annotations

import mlx.core as mx


def token_count(mask: mx.array) -> mx.array:
    """A grid's number of tokens, never below 1 (an all-padding grid has mean 0, not NaN)."""
    return mx.maximum(mask.sum(), 1.0)


def masked_mean(x: mx.array, mask: mx.array, denominator: mx.array | None = None) -> mx.array:
    return (x * mask).sum() / (token_count(mask) if denominator is None else denominator)


def policy_loss(
    logprob: mx.array,
    old_logprob: mx.array,
    advantage: mx.array,
    mask: mx.array,
    clip_range: float,
    entropy: mx.array | None = None,
    entropy_coef: float = 0.0,
    denominator: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """PPO-clip surrogate (to minimise) and its diagnostics."""
    log_ratio = logprob - old_logprob
    ratio = mx.exp(log_ratio)
    unclipped = -advantage * ratio
    clipped = -advantage * mx.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg = masked_mean(mx.maximum(unclipped, clipped), mask, denominator)
    ent = masked_mean(entropy, mask, denominator) if entropy is not None else mx.array(float("nan"))
    loss = pg - entropy_coef * ent if entropy is not None else pg
    stats = {
        "policy_loss": pg,
        "entropy": ent,
        # k3 estimator of KL(old || new): unbiased and always >= 0
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask, denominator),
        "clip_fraction": masked_mean((mx.abs(ratio - 1.0) > clip_range).astype(mx.float32), mask, denominator),
    }
    return loss, stats


def value_loss(
    value: mx.array,
    old_value: mx.array,
    returns: mx.array,
    mask: mx.array,
    clip_range: float,
    denominator: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2)."""
    v_clipped = old_value + mx.clip(value - old_value, -clip_range, clip_range)
    loss = 0.5 * masked_mean(mx.maximum((value - returns) ** 2, (v_clipped - returns) ** 2), mask, denominator)
    frac = masked_mean((mx.abs(value - old_value) > clip_range).astype(mx.float32), mask, denominator)
    return loss, {"value_loss": loss, "value_clip_fraction": frac}
