"""The CPU attention: MLX's own to float precision for every mask kind, its exact gradient, no NaN for unseen rows."""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest

from ppo_core.attention import attention, softmax, use_fast_attention


def _qkv(batch: int, heads: int, kv_heads: int, n_queries: int, n_keys: int, seed: int = 0):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, heads, n_queries, 16), key=keys[0]) * 3
    k = mx.random.normal((batch, kv_heads, n_keys, 16), key=keys[1]) * 3
    v = mx.random.normal((batch, kv_heads, n_keys, 16), key=keys[2])
    return q, k, v


MASKS = {
    "none": lambda b, h, lq, lk: None,
    "causal": lambda b, h, lq, lk: "causal",
    "bool per row": lambda b, h, lq, lk: mx.array(np.random.default_rng(1).random((b, 1, lq, lk)) > 0.3) | mx.eye(lq, lk, k=lk - lq, dtype=mx.bool_),
    "bool per head": lambda b, h, lq, lk: mx.array(np.random.default_rng(2).random((b, h, lq, lk)) > 0.3) | mx.eye(lq, lk, k=lk - lq, dtype=mx.bool_),
    "additive 2-d": lambda b, h, lq, lk: mx.array(np.random.default_rng(3).normal(size=(lq, lk)).astype(np.float32)),
}


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize("shape", [(2, 6, 2, 7, 7), (3, 4, 4, 1, 9), (2, 6, 3, 5, 12)], ids=["gqa-square", "mha-decode", "gqa-offset"])
def test_attention_matches_mlx(shape, mask_kind):
    b, h, kv, lq, lk = shape
    q, k, v = _qkv(b, h, kv, lq, lk)
    mask = MASKS[mask_kind](b, h, lq, lk)
    ours = attention(q, k, v, scale=0.25, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(ref), atol=2e-6, rtol=1e-5)

    weights = mx.random.normal(ref.shape, key=mx.random.key(9))
    grad = lambda fn: mx.grad(lambda q, k, v: (fn(q, k, v, scale=0.25, mask=mask) * weights).sum(), argnums=(0, 1, 2))(q, k, v)  # noqa: E731
    for a, r in zip(grad(attention), grad(mx.fast.scaled_dot_product_attention)):
        np.testing.assert_allclose(np.array(a), np.array(r), atol=2e-5, rtol=1e-4)


def test_softmax_gradient_is_exact():
    x = mx.random.normal((5, 33), key=mx.random.key(4)) * 10
    w = mx.random.normal((5, 33), key=mx.random.key(5))
    ours = mx.grad(lambda x: (softmax(x) * w).sum())(x)
    ref = mx.grad(lambda x: (mx.softmax(x, axis=-1, precise=True) * w).sum())(x)
    np.testing.assert_allclose(np.array(ours), np.array(ref), atol=1e-6)


def test_a_query_that_sees_no_key_stays_finite():
    # a left-padded prompt position while sampling: no key is visible, and its output must not poison others with NaN
    q, k, v = _qkv(1, 2, 2, 3, 3)
    mask = mx.array([[[[False, False, False], [True, True, False], [True, True, True]]]])
    out = np.array(attention(q, k, v, scale=0.25, mask=mask))
    assert np.isfinite(out).all()
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask))
    np.testing.assert_allclose(out[:, :, 1:], ref[:, :, 1:], atol=2e-6)


def test_routing_keeps_the_original_for_what_it_does_not_handle():
    calls = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append(sinks)
        return "original"

    module = types.SimpleNamespace(scaled_dot_product_attention=original)
    assert use_fast_attention(module) and use_fast_attention(module)  # idempotent
    q, k, v = _qkv(1, 2, 1, 2, 2)
    assert module.scaled_dot_product_attention(q, k, v, cache=None, scale=1.0, mask=None, sinks=mx.zeros((2,))) == "original"
    assert module.scaled_dot_product_attention(q, k, v, cache=types.SimpleNamespace(bits=4), scale=1.0, mask=None) == "original"
    out = module.scaled_dot_product_attention(q, k, v, cache=None, scale=1.0, mask=None)
    assert out.shape == q.shape and len(calls) == 2
    assert not use_fast_attention(types.SimpleNamespace())  # an architecture without the hook is left alone
