"""Scaled dot-product attention with a vectorised softmax, for MLX's CPU backend.

MLX's CPU attention (``mx.fast.scaled_dot_product_attention``) takes its
softmax with the scalar libm ``exp`` (about 20 ns per element here): at 64
rollouts of ~108 tokens that is ~130 ms per layer in a scoring pass, and in a
decoding step at batch 64 it is 1.2 of the 1.6 ms each layer's attention takes.
This one computes the scores with one batched matmul per key/value head
(grouped-query heads share their keys without copying them), the softmax with
``ppo_core.activations.fast_exp`` fused by ``mx.compile``, and its exact
gradient (``p * (g - sum(g * p))``, a custom VJP).

Masks follow ``mx.fast``'s conventions: ``"causal"`` (the last query sees every
key), a boolean array (True: attend) or an additive one. Masked scores are a
large finite negative, not ``-inf``, so a query that sees no key (a left-padded
prompt position while sampling) averages the values instead of making NaNs
that would reach real positions through ``0 * NaN``.

``use_fast_attention(module)`` puts it in place of the ``scaled_dot_product_attention``
that an ``mlx_lm`` model module calls (process-wide for that architecture: the
results equal ``mx.fast``'s to float rounding); quantised KV caches, attention
sinks and non-CPU devices still go to the original.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx

from ppo_core.activations import fast_exp

MASKED = -1e30  # a masked score: exp(MASKED - max) is ~1e-38 of a real key's weight, and never NaN


@mx.compile
def _softmax_forward(scores: mx.array) -> mx.array:
    e = fast_exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@mx.compile
def _softmax_backward(p: mx.array, cotangent: mx.array) -> mx.array:
    return p * (cotangent - (cotangent * p).sum(axis=-1, keepdims=True))


@mx.custom_function
def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis (float32 in, float32 out)."""
    return _softmax_forward(scores)


@softmax.vjp
def _softmax_vjp(primals, cotangent, output):
    return _softmax_backward(output, cotangent)


def _causal(n_queries: int, n_keys: int) -> mx.array:
    # query i is the (n_keys - n_queries + i)-th position: it sees every key up to itself
    return mx.arange(n_keys)[None, :] <= mx.arange(n_queries)[:, None] + (n_keys - n_queries)


def attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any = None) -> mx.array:
    """``softmax(scale * q @ k.T + mask) @ v`` for (B, Hq, Lq, D) queries and (B, Hkv, Lk, D) keys/values."""
    B, n_heads, n_queries, dim = queries.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    group = n_heads // n_kv
    # heads h = kv * group + j share key head kv: (B, Hkv, group * Lq, D) is a view, one matmul per key head
    q = (queries * scale).reshape(B, n_kv, group * n_queries, dim)
    scores = (q @ keys.swapaxes(-1, -2)).astype(mx.float32).reshape(B, n_kv, group, n_queries, n_keys)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = _causal(n_queries, n_keys)
    if mask is not None:
        # (..., Lq, Lk) with optional (batch, heads) in front: heads, if per head, split like the queries
        if mask.ndim == 4:
            mask = mask.reshape(mask.shape[0], n_kv, group, n_queries, n_keys) if mask.shape[1] == n_heads else mask[:, :, None]
        scores = mx.where(mask, scores, MASKED) if mask.dtype == mx.bool_ else scores + mask.astype(mx.float32)
    p = softmax(scores).astype(values.dtype).reshape(B, n_kv, group * n_queries, n_keys)
    return (p @ values).reshape(B, n_heads, n_queries, dim)


def use_fast_attention(module: ModuleType) -> bool:
    """Route ``module.scaled_dot_product_attention`` (an mlx_lm model module) through ``attention`` on the CPU.

    Returns whether the module calls that function (an architecture that does
    its own attention is left alone). Idempotent.
    """
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        return False
    if getattr(original, "_ppo_fast", False):
        return True

    def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
        if sinks is not None or hasattr(cache, "bits") or mx.default_device() != mx.cpu:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return attention(queries, keys, values, scale=scale, mask=mask)

    scaled_dot_product_attention._ppo_fast = True  # type: ignore[attr-defined]
    module.scaled_dot_product_attention = scaled_dot_product_attention
    return True
