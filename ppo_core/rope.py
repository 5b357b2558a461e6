"""Rotary position embedding that computes its rotation once per decoding step, for MLX's CPU backend.

MLX has no CPU kernel for ``mx.fast.rope``: each call composes about fifteen
operations (positions, inverse frequencies, cosines, sines, the rotation).
While sampling, every layer rotates its queries and its keys at the same
positions: 60 calls per step for SmolLM2's 30 layers, ~65 µs each at batch 16
here, most of it the same cosines and sines again. ``SharedRoPE`` applies the
rotation with the operations MLX's own composition uses, in its order, so the
results are bit-identical (tests/test_rope.py), and computes it once for an
offset array that was handed to ``share_rotation``: ``ppo_core.generate``
registers each step's positions, one array object that every layer receives
and nobody changes in place (an MLX array can be: ``+=`` keeps the object, so
only registered arrays are remembered). Other array offsets are rotated
without remembering; integer offsets (scoring, training) and the
traditional layout go to ``mx.fast.rope`` unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_KEPT = 4  # offsets remembered: one step's, with room for another generation interleaved
# id -> (the registered offset array, kept alive so ids stay unique; its rotations by (length, dims, base, scale, dtype))
_SHARED: OrderedDict[int, tuple[mx.array, dict]] = OrderedDict()


def share_rotation(offset: mx.array) -> mx.array:
    """Register ``offset`` (never to be changed in place) so that every ``SharedRoPE`` rotates by it once; returns it."""
    _SHARED[id(offset)] = (offset, {})
    while len(_SHARED) > _KEPT:
        _SHARED.popitem(last=False)
    return offset


@functools.cache
def _libm_logf():
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        libm.logf.restype, libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]
        return libm.logf
    except (OSError, AttributeError):
        return None


def _logf(x: float) -> np.float32:
    """``std::log(float)`` as MLX's C++ takes it (glibc's ``logf``), for the same inverse frequencies to the bit."""
    logf = _libm_logf()
    return np.float32(logf(x)) if logf is not None else np.float32(math.log(np.float32(x)))


class SharedRoPE(nn.Module):
    """``nn.RoPE`` (non-traditional) whose cosines and sines for an offset array are computed once and shared."""

    def __init__(self, rope: nn.RoPE):
        super().__init__()
        self.dims, self.traditional, self.base, self.scale = rope.dims, rope.traditional, rope.base, rope.scale
        half = self.dims // 2
        # MLX: exp(arange(0, -half, -1) * (std::log(base) / half)), all in float32
        self._log_step = np.float32(_logf(self.base) / np.float32(half))

    def _rotation(self, offset: mx.array, length: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        registered = _SHARED.get(id(offset))  # the entry holds its array: no other one has that id meanwhile
        remembered = registered[1] if registered is not None else None
        key = (length, self.dims, self.base, self.scale, dtype)
        if remembered is not None and key in remembered:
            return remembered[key]
        positions = (mx.arange(length, dtype=mx.float32) + offset.reshape(-1, 1, 1)) * mx.array(self.scale, mx.float32)
        inv_freqs = mx.exp(mx.arange(0, -(self.dims // 2), -1, dtype=mx.float32) * mx.array(self._log_step))
        theta = positions[..., None] * inv_freqs
        cos, sin = mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)
        if remembered is not None:
            remembered[key] = (cos, sin)
        return cos, sin

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.traditional or not isinstance(offset, mx.array) or offset.ndim != 1 or x.ndim != 4:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)
        cos, sin = self._rotation(offset, x.shape[2], x.dtype)
        half = self.dims // 2
        x1, x2 = x[..., :half], x[..., half : self.dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if self.dims < x.shape[-1]:
            parts.append(x[..., self.dims :])
        return mx.concatenate(parts, axis=-1)


def share_rope(layers: list[nn.Module]) -> int:
    """Put ``SharedRoPE`` in place of each layer's attention ``nn.RoPE`` (exactly that class); returns how many."""
    count = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and type(getattr(attn, "rope", None)) is nn.RoPE and not attn.rope.traditional:
            attn.rope = SharedRoPE(attn.rope)
            count += 1
    return count
