"""Token log-probabilities and entropies over the vocabulary head, in chunks of positions.

The head's matmul runs in MLX (OpenBLAS); the softmax statistics over the
vocabulary run in NumPy. On CPU, MLX's element-wise ``exp`` is scalar (about
17 ns per element here, NumPy's vectorised one about 1.2 ns), and at a
49,152-way vocabulary those statistics cost more than the matmul itself.
Positions go through in chunks, so one chunk's logits (``CHUNK_ROWS`` x vocab
floats) is the working set instead of a whole minibatch's, and only the
positions of real response tokens are computed.

For training, ``head_stats(moments=True)`` also computes the softmax-weighted
sums of the head's rows that the gradient needs (``E = p @ W``, and for the
entropy ``G``), so no logits are kept for the backward pass and none are
recomputed (``ppo_core.train.PPOStep`` takes the gradient from there):

    d logprob_t / d h = (W[t] - E) / T
    d entropy / d h   = -G / T,  G = (p * (l - max)) @ W + (H - log s) E

with ``l`` the tempered logits, ``s`` the sum of ``exp(l - max)`` and ``H``
the entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

CHUNK_ROWS = 128  # positions per chunk: 128 x 49,152 float32 logits = 25 MB


@dataclass
class HeadStats:
    """Per position: log p(target) and, when asked for, the entropy; with ``moments``, the gradient's E and G."""

    logprob: np.ndarray
    entropy: np.ndarray | None
    expected_row: mx.array | None = None  # E = p @ W, (N, H)
    entropy_row: mx.array | None = None  # G, (N, H)


def _chunk(model, h: mx.array, targets: np.ndarray, temperature: float, entropy: bool, moments: bool, weight: mx.array):
    logits = model.logits_from_hidden(h).astype(mx.float32)  # a half-precision model's too
    mx.eval(logits)
    # one division per logit, as ``logits / temperature`` in MLX: the same float bits
    lt = np.divide(np.asarray(logits), np.float32(temperature), dtype=np.float32)
    lt -= lt.max(axis=1, keepdims=True)
    e = np.exp(lt)
    s = e.sum(axis=1)
    log_s = np.log(s)
    logprob = lt[np.arange(len(targets)), targets] - log_s
    ent = None
    if entropy:
        ent = log_s - np.einsum("ij,ij->i", e, lt) / s
    if not moments:
        return logprob, ent, None, None
    e /= s[:, None]  # p
    expected = mx.array(e) @ weight
    ent_row = None
    if entropy:
        ent_row = mx.array(e * lt) @ weight + mx.array((ent - log_s)[:, None]) * expected
    return logprob, ent, expected, ent_row


def head_stats(
    model, h: mx.array, targets: np.ndarray, temperature: float, *, entropy: bool = True, moments: bool = False
) -> HeadStats:
    """Statistics of the head at ``h`` (N, H) for ``targets`` (N,), ``CHUNK_ROWS`` positions at a time."""
    weight = model.head_weight
    parts = [
        _chunk(model, h[lo : lo + CHUNK_ROWS], targets[lo : lo + CHUNK_ROWS], temperature, entropy, moments, weight)
        for lo in range(0, h.shape[0], CHUNK_ROWS)
    ]
    if not parts:
        empty = np.zeros(0, np.float32)
        return HeadStats(empty, empty if entropy else None,
                         mx.zeros((0, weight.shape[1])) if moments else None, mx.zeros((0, weight.shape[1])) if moments and entropy else None)
    cat = np.concatenate
    return HeadStats(
        logprob=cat([p[0] for p in parts]).astype(np.float32),
        entropy=cat([p[1] for p in parts]).astype(np.float32) if entropy else None,
        expected_row=mx.concatenate([p[2] for p in parts]) if moments else None,
        entropy_row=mx.concatenate([p[3] for p in parts]) if moments and entropy else None,
    )
