"""GGUF conversion helpers: rope un-permutation and per-tensor dequantisation."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import numpy as np
import pytest

from ppo_core.convert import GROUP_SIZE, _dequantize, _unpermute_rope


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("n_heads", [9, 3])
@pytest.mark.parametrize("cols", [576, 64])
def test_unpermute_rope_inverts_llama_cpp(n_heads, cols):
    head_dim = 64
    rng = np.random.default_rng(n_heads * 1000 + cols)
    w = rng.normal(size=(n_heads * head_dim, cols)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)  # the permutation really moves rows
    out = _unpermute_rope(mx.array(permuted), n_heads)
    assert out.shape == w.shape
    np.testing.assert_array_equal(np.array(out), w)


def test_unpermute_rope_row_order():
    # rows labelled by index: within each head, GGUF row 2*i is HF row i and 2*i+1 is HF row i + head_dim/2
    n_heads, head_dim = 3, 8
    rows = n_heads * head_dim
    w = np.repeat(np.arange(rows, dtype=np.float32)[:, None], 2, axis=1)
    out = np.array(_unpermute_rope(mx.array(llama_cpp_permute(w, n_heads)), n_heads))
    np.testing.assert_array_equal(out[:, 0], np.arange(rows))
    permuted = llama_cpp_permute(w, n_heads)[:, 0]
    np.testing.assert_array_equal(permuted[:head_dim], [0, 4, 1, 5, 2, 6, 3, 7])


def test_unpermute_rope_is_not_identity_with_wrong_head_count():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(9 * 64, 32)).astype(np.float32)
    out = np.array(_unpermute_rope(mx.array(llama_cpp_permute(w, 9)), 3))
    assert not np.allclose(out, w)


def quantized_weights(w: mx.array, stem: str, bits: int) -> dict[str, mx.array]:
    wq, scales, biases = mx.quantize(w, group_size=GROUP_SIZE, bits=bits)
    # GGUF stores the block scales/mins as float16
    return {f"{stem}.weight": wq, f"{stem}.scales": scales.astype(mx.float16), f"{stem}.biases": biases.astype(mx.float16)}


def assert_close_to_quantisation_grid(out: mx.array, w: mx.array, bits: int) -> None:
    """|out - w| within about one quantisation step of each 32-wide group (min-max range / (2^bits - 1))."""
    W = np.array(w).reshape(w.shape[0], -1, GROUP_SIZE)
    step = (W.max(-1) - W.min(-1)) / (2**bits - 1)
    err = np.abs(np.array(out).reshape(W.shape) - W).max(-1)
    assert np.all(err <= 1.1 * step + 1e-3), float((err / step).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(64, 128), (96, 576)])
def test_dequantize_infers_bits(bits, shape):
    w = mx.random.normal(shape, key=mx.random.key(bits + shape[1]))
    weights = quantized_weights(w, "blk.0.attn_q", bits)
    out = _dequantize(weights, "blk.0.attn_q")
    assert out.shape == w.shape
    assert out.dtype == mx.float32
    assert_close_to_quantisation_grid(out, w, bits)
    # exactly what dequantising with the right bit width gives
    ref = mx.dequantize(
        weights["blk.0.attn_q.weight"],
        weights["blk.0.attn_q.scales"].astype(mx.float32),
        weights["blk.0.attn_q.biases"].astype(mx.float32),
        group_size=GROUP_SIZE,
        bits=bits,
    )
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-6, atol=1e-6)
    # 8-bit is much finer than 4-bit could be: the inferred width is the real one
    err = np.abs(np.array(out) - np.array(w)).mean()
    assert err < (0.01 if bits == 8 else 0.2)


def test_dequantize_mixed_bits_in_one_checkpoint():
    # Q8_0 embedding next to Q4 layers: each tensor gets its own bit width
    e = mx.random.normal((48, 64), key=mx.random.key(1))
    q = mx.random.normal((64, 64), key=mx.random.key(2))
    weights = {**quantized_weights(e, "token_embd", 8), **quantized_weights(q, "blk.0.attn_k", 4)}
    e_out = _dequantize(weights, "token_embd")
    q_out = _dequantize(weights, "blk.0.attn_k")
    assert e_out.shape == e.shape and q_out.shape == q.shape
    assert_close_to_quantisation_grid(e_out, e, 8)
    assert_close_to_quantisation_grid(q_out, q, 4)


def test_dequantize_plain_tensor_is_float32():
    w = mx.random.normal((8, 32), key=mx.random.key(3)).astype(mx.float16)
    out = _dequantize({"output_norm.weight": w}, "output_norm")
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(np.array(out), np.array(w.astype(mx.float32)))
