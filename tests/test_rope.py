"""The decoding path's shared rotary embedding and preallocated cache give MLX's own numbers, to the bit."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache

from ppo_core.config import PPOConfig
from ppo_core.generate import DecodeCache, _Positions
from ppo_core.models import POLICY, ModelCache
from ppo_core.rope import SharedRoPE, share_rotation
from ppo_core.tiny import make_tiny_model


@pytest.mark.parametrize("dims,head_dim,base,scale", [(64, 64, 100000.0, 1.0), (32, 64, 10000.0, 0.5), (128, 128, 1e6, 1.0)])
def test_shared_rope_is_bit_identical_to_mlx(dims, head_dim, base, scale):
    rope = nn.RoPE(dims, base=base, scale=scale)
    shared = SharedRoPE(rope)
    rng = np.random.default_rng(dims)
    for batch, heads, length in [(16, 9, 1), (4, 3, 7), (64, 9, 1)]:
        x = mx.array(rng.normal(size=(batch, heads, length, head_dim)).astype(np.float32))
        offset = mx.array(rng.integers(-40, 4000, batch).astype(np.int32))
        assert mx.array_equal(shared(x, offset=offset), rope(x, offset=offset))  # not registered: not remembered
        share_rotation(offset)
        for _ in range(2):  # computed, then remembered
            assert mx.array_equal(shared(x, offset=offset), rope(x, offset=offset))
        assert mx.array_equal(shared(x, offset=5), rope(x, offset=5))  # integer offsets go to mx.fast.rope


def test_decoding_cache_gives_the_hidden_states_of_mlx_lms_cache(tmp_path):
    cfg = PPOConfig(model=str(make_tiny_model(tmp_path / "m", seed=3, layers=3)), artifact_root=tmp_path / "art", lora_layers=2)
    model = ModelCache().get(cfg)
    assert any(isinstance(layer.self_attn.rope, SharedRoPE) for layer in model.backbone.layers)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 9, 2, 7)]
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    tokens = mx.array([[model.pad_token_id] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    ours_pos = _Positions(pads)
    ours = [DecodeCache(pads, ours_pos, width + 5) for _ in model.backbone.layers]
    theirs = [BatchKVCache(pads) for _ in model.backbone.layers]
    x_ours = x_theirs = tokens
    for _ in range(6):
        h_ours = model.hidden(x_ours, POLICY, cache=ours)[:, -1]
        ours_pos.advance(x_ours.shape[1])
        h_theirs = model.hidden(x_theirs, POLICY, cache=theirs)[:, -1]
        assert mx.array_equal(h_ours, h_theirs)
        x_ours = x_theirs = mx.array(rng.integers(3, 300, (4, 1)).astype(np.int32))
    with pytest.raises(ValueError, match="overflows"):
        model.hidden(x_ours, POLICY, cache=ours)
