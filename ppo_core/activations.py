"""SwiGLU with a vectorisable exponential, for MLX's CPU backend.

MLX's CPU ``sigmoid``/``exp`` call the scalar libm function per element
(about 20 ns each here, against 0.3 ns for a multiply): in SmolLM2's MLP the
SiLU of the gate costs as much as the three matmuls around it. Here ``exp`` is
``2**round(t) * p(t - round(t))`` with ``t = x * log2(e)``: a degree-6
polynomial on [-1/2, 1/2] (relative error below 1e-7, about one float32 ulp)
and an exponent written into the float's bits, all of it plain arithmetic that
``mx.compile`` fuses into one loop. The gradient is SiLU's exact derivative
(a custom VJP), not the polynomial's.

``swap_mlps`` puts ``SwiGLU`` in place of each layer's MLP, keeping the
parameter paths (``mlp.gate_proj`` ...) so adapters and checkpoints are
unchanged. It is used on the CPU only: on a GPU the built-in kernels are fast.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

# least-squares fit of 2**f on Chebyshev nodes of [-1/2, 1/2], relative error < 1e-7 in float32
_EXP2 = (1.0, 0.6931471824645996, 0.24022646248340607, 0.05550329014658928, 0.009618519805371761,
         0.0013399859890341759, 0.00015337577497120947)
_LOG2E = 1.0 / math.log(2.0)


def fast_exp(x: mx.array) -> mx.array:
    """``exp(x)`` to about one float32 ulp, in plain arithmetic that ``mx.compile`` fuses into one loop."""
    t = mx.clip(x * _LOG2E, -126.0, 126.0)  # within float32's normal exponents
    n = mx.round(t)
    f = t - n
    p = _EXP2[-1]
    for c in reversed(_EXP2[:-1]):
        p = p * f + c
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


def _sigmoid(x: mx.array) -> mx.array:
    return 1.0 / (1.0 + fast_exp(-x))


@mx.compile
def _forward(gate: mx.array, up: mx.array) -> tuple[mx.array, mx.array]:
    s = _sigmoid(gate)
    return gate * s * up, s


@mx.compile
def _backward(gate: mx.array, up: mx.array, s: mx.array, cotangent: mx.array) -> tuple[mx.array, mx.array]:
    silu = gate * s
    return cotangent * up * (s + silu * (1.0 - s)), cotangent * silu


@mx.custom_function
def _swiglu(gate: mx.array, up: mx.array) -> tuple[mx.array, mx.array]:
    return _forward(gate, up)


@_swiglu.vjp
def _swiglu_vjp(primals, cotangents, outputs):
    gate, up = primals
    # the sigmoid is an output of the forward pass, kept for this (as MLX keeps its own sigmoid's)
    return _backward(gate, up, outputs[1], cotangents[0])


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``."""
    return _swiglu(gate, up)[0]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the projections of the MLP it replaces (same parameter names)."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


MLP_PROJECTIONS = {"gate_proj", "up_proj", "down_proj"}


def swap_mlps(layers: list[nn.Module]) -> int:
    """Replace each layer's SwiGLU MLP (an MLP of exactly the three projections) by ``SwiGLU``; returns how many."""
    count = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or type(mlp).__name__ != "MLP" or set(mlp.children()) != MLP_PROJECTIONS:
            continue
        layer.mlp = SwiGLU(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        count += 1
    return count


def use_fast_activations() -> bool:
    """On MLX's CPU backend only (its scalar exp is what this replaces), and only where mx.compile works.

    MLX compiles fused CPU kernels with the system's C++ compiler; without one
    the built-in SiLU is used.
    """
    if mx.default_device() != mx.cpu:
        return False
    try:
        mx.eval(swiglu(mx.zeros((2,)), mx.zeros((2,))))
    except Exception:  # no compiler, or a backend that cannot compile
        return False
    return True
