"""The CPU SwiGLU: the model's own MLP to float precision, the exact gradient, the same parameter paths."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ppo_core import activations
from ppo_core.activations import SwiGLU, swap_mlps, swiglu
from ppo_core.config import PPOConfig
from ppo_core.models import POLICY, ModelCache
from ppo_core.tiny import make_tiny_model


def test_swiglu_matches_silu_to_float_precision():
    gate = mx.concatenate([mx.random.normal((4000,), key=mx.random.key(0)) * 8, mx.array([-500.0, -87.0, 0.0, 87.0, 500.0])])
    up = mx.random.normal(gate.shape, key=mx.random.key(1))
    ours, ref = np.array(swiglu(gate, up)), np.array(nn.silu(gate) * up)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-30)


def test_swiglu_gradient_is_silus():
    gate, up = mx.random.normal((300,), key=mx.random.key(2)) * 5, mx.random.normal((300,), key=mx.random.key(3))
    weights = mx.random.normal((300,), key=mx.random.key(4))
    ours = mx.grad(lambda g, u: (swiglu(g, u) * weights).sum(), argnums=(0, 1))(gate, up)
    ref = mx.grad(lambda g, u: (nn.silu(g) * u * weights).sum(), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_swapped_model_keeps_paths_and_outputs(tmp_path, model_type, monkeypatch):
    path = make_tiny_model(tmp_path / "m", seed=1, layers=2, model_type=model_type)
    targets = ("q_proj", "gate_proj", "down_proj")
    fast = ModelCache().get(PPOConfig(model=str(path), artifact_root=tmp_path, lora_layers=2, lora_targets=targets))
    monkeypatch.setattr("ppo_core.models.use_fast_activations", lambda: False)
    plain = ModelCache().get(PPOConfig(model=str(path), artifact_root=tmp_path, lora_layers=2, lora_targets=targets))
    assert all(isinstance(layer.mlp, SwiGLU) for layer in fast.backbone.layers)
    assert not any(isinstance(layer.mlp, SwiGLU) for layer in plain.backbone.layers)
    # same parameter names: checkpoints and adapters load into either
    assert sorted(k for k, _ in tree_flatten(fast.lm.parameters())) == sorted(k for k, _ in tree_flatten(plain.lm.parameters()))
    assert any(".mlp.gate_proj.adapters.policy." in k for k in fast.trainable(POLICY))
    tokens = mx.array([[5, 9, 14, 3, 7, 22]])
    for m in (fast, plain):
        m.reset_adapters(seed=4)
    with fast.adapter(POLICY), plain.adapter(POLICY):
        np.testing.assert_allclose(np.array(fast.lm(tokens)), np.array(plain.lm(tokens)), atol=1e-5)


def test_other_mlps_are_left_alone():
    class MLP(nn.Module):  # an MLP with more than the three SwiGLU projections
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.extra = (nn.Linear(2, 2) for _ in range(4))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

    layers = [Layer()]
    assert swap_mlps(layers) == 0 and isinstance(layers[0].mlp, MLP)


def test_fast_activations_only_on_cpu():
    assert activations.use_fast_activations() == (mx.default_device() == mx.cpu)
