"""Token log-probabilities and entropies over the vocabulary head, in chunks of positions.

Positions go through in chunks, so one chunk's logits (``CHUNK_ROWS`` x vocab
floats) is the working set instead of a whole minibatch's, and only the
positions of real response tokens are computed. Two implementations:

- ``head_stats`` (scoring, no gradient): the head's matmul in MLX (OpenBLAS),
  the softmax statistics in NumPy. MLX's CPU element-wise ``exp`` is scalar
  (about 17 ns per element here, NumPy's vectorised one about 1.2 ns).
- ``token_stats`` (training): the same statistics as MLX operations (the
  exponential is ``ppo_core.activations.fast_exp``; ``mx.compile`` does not
  fuse it inside a gradient trace, so there it runs op by op), so they sit in
  the gradient's graph and a policy step is one forward and one
  backward pass of the adapted layers. Its custom VJP keeps no logits: the
  forward also computes the softmax-weighted sums of the head's rows that the
  gradient needs,

    d logprob_t / d h = (W[t] - E) / T,   E = p @ W
    d entropy / d h   = -G / T,           G = (p * (l - max)) @ W + (H - log s) E

  with ``l`` the tempered logits, ``s`` the sum of ``exp(l - max)`` and ``H``
  the entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ppo_core.activations import fast_exp, use_fast_activations

CHUNK_ROWS = 128  # positions per chunk: 128 x 49,152 float32 logits = 25 MB


@dataclass
class HeadStats:
    """Per position: log p(target) and, when asked for, the entropy."""

    logprob: np.ndarray
    entropy: np.ndarray | None


def _chunk(model, h: mx.array, targets: np.ndarray, temperature: float, entropy: bool):
    logits = model.logits_from_hidden(h).astype(mx.float32)  # a half-precision model's too
    mx.eval(logits)
    # one division per logit, as ``logits / temperature`` in MLX: the same float bits
    lt = np.divide(np.asarray(logits), np.float32(temperature), dtype=np.float32)
    lt -= lt.max(axis=1, keepdims=True)
    e = np.exp(lt)
    s = e.sum(axis=1)
    log_s = np.log(s)
    logprob = lt[np.arange(len(targets)), targets] - log_s
    ent = log_s - np.einsum("ij,ij->i", e, lt) / s if entropy else None
    return logprob, ent


def head_stats(model, h: mx.array, targets: np.ndarray, temperature: float, *, entropy: bool = True) -> HeadStats:
    """Statistics of the head at ``h`` (N, H) for ``targets`` (N,), ``CHUNK_ROWS`` positions at a time."""
    parts = [
        _chunk(model, h[lo : lo + CHUNK_ROWS], targets[lo : lo + CHUNK_ROWS], temperature, entropy)
        for lo in range(0, h.shape[0], CHUNK_ROWS)
    ]
    if not parts:
        empty = np.zeros(0, np.float32)
        return HeadStats(empty, empty if entropy else None)
    cat = np.concatenate
    return HeadStats(
        logprob=cat([p[0] for p in parts]).astype(np.float32),
        entropy=cat([p[1] for p in parts]).astype(np.float32) if entropy else None,
    )


def _shifted(exp):
    def shifted_exp(logits: mx.array, inv_temperature: mx.array, top: mx.array) -> tuple[mx.array, mx.array]:
        shifted = logits * inv_temperature - top
        return shifted, exp(shifted)

    return mx.compile(shifted_exp)


_SHIFTED_EXP = {True: _shifted(fast_exp), False: _shifted(mx.exp)}  # by use_fast_activations()


@mx.compile
def _probabilities(e: mx.array, shifted: mx.array, s: mx.array) -> tuple[mx.array, mx.array]:
    p = e / s
    return p, p * shifted


def _fast_exp_here() -> bool:
    device = mx.default_device()
    if device not in _FAST:
        _FAST[device] = use_fast_activations()
    return _FAST[device]


_FAST: dict = {}  # device -> whether the vectorised exp is used there (asked once per device)


def _stats_chunk(model, h: mx.array, targets: mx.array, inv_t: mx.array, entropy: bool, fast: bool) -> mx.array:
    """One chunk's ``[logprob, E]`` (or ``[logprob, E, entropy, G]``) side by side, (n, 1 + H) or (n, 2 + 2H).

    Packed in one array so that evaluating any column computes the whole
    chunk at once: its logits are freed before the next chunk's are made.
    """
    weight = model.head_weight
    logits = model.logits_from_hidden(h).astype(mx.float32)
    # times 1/T and fast_exp, where scoring divides and takes NumPy's exp: the logprobs agree to
    # float rounding (a ratio of 1 +- 1e-6 before the first step), not to the bit
    top = logits.max(axis=1, keepdims=True) * inv_t  # max(l) / T = max(l / T): rounding is monotonic
    shifted, e = _SHIFTED_EXP[fast](logits, inv_t, top)
    s = e.sum(axis=1, keepdims=True)
    log_s = mx.log(s)
    logprob = mx.take_along_axis(shifted, targets[:, None], axis=1) - log_s
    p, p_shifted = _probabilities(e, shifted, s)
    expected = p @ weight
    if not entropy:
        return mx.concatenate([logprob, expected], axis=1)
    ent = log_s - p_shifted.sum(axis=1, keepdims=True)
    entropy_row = p_shifted @ weight + (ent - log_s) * expected
    return mx.concatenate([logprob, expected, ent, entropy_row], axis=1)


def token_stats(
    model, h: mx.array, targets: np.ndarray, temperature: float, *, entropy: bool
) -> tuple[mx.array, mx.array | None]:
    """Differentiable (logprob, entropy or None) of ``targets`` (N,) at ``h`` (N, H); the head itself stays frozen."""
    weight = model.head_weight
    hidden = weight.shape[1]
    index = mx.array(np.asarray(targets, dtype=np.int32))
    inv_t = mx.array(1.0 / temperature, dtype=mx.float32)
    fast = _fast_exp_here()  # the vectorised exp on the CPU, MLX's own elsewhere

    @mx.custom_function
    def packed_stats(x: mx.array) -> mx.array:
        parts = [
            _stats_chunk(model, x[lo : lo + CHUNK_ROWS], index[lo : lo + CHUNK_ROWS], inv_t, entropy, fast)
            for lo in range(0, x.shape[0], CHUNK_ROWS)
        ]
        width = 2 + 2 * hidden if entropy else 1 + hidden
        return mx.concatenate(parts, axis=0) if parts else mx.zeros((0, width), mx.float32)

    @packed_stats.vjp
    def packed_stats_vjp(x, cotangent, output):  # one primal: MLX passes it, its cotangent and output bare
        d_x = cotangent[:, :1] * (weight[index].astype(mx.float32) - output[:, 1 : 1 + hidden])
        if entropy:
            d_x = d_x - cotangent[:, 1 + hidden : 2 + hidden] * output[:, 2 + hidden :]
        return (d_x * inv_t).astype(x.dtype)

    out = packed_stats(h)
    return out[:, 0], (out[:, 1 + hidden] if entropy else None)
