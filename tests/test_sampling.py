"""The sampler's NumPy Gumbel-max draws what ``mx.random.categorical`` draws from the same keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ppo_core.generate import _sample_step, _split_rows, _uniform_rows


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_same_tokens_as_mlx_categorical(temperature):
    rows, vocab = 64, 3000
    logits = mx.random.normal((rows, vocab), key=mx.random.key(1)) * 4
    keys = mx.stack([mx.random.key(s) for s in range(100, 100 + rows)])
    draws, expected = [], []
    for _ in range(5):  # several steps of the per-row key chain, as in generate
        split = _split_rows(keys)
        keys = split[:, 0]
        scaled = logits / temperature
        lp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        expected.append(np.array(mx.vmap(lambda k, row: mx.random.categorical(row, key=k))(split[:, 1], lp)))
        nxt, tok_lp = _sample_step(np.array(logits), temperature, np.array(_uniform_rows(split[:, 1], vocab)))
        draws.append(nxt)
        np.testing.assert_allclose(tok_lp, np.take_along_axis(np.array(lp), nxt[:, None], 1)[:, 0], atol=1e-5)
    assert (np.array(draws) == np.array(expected)).mean() == 1.0
    assert len(np.unique(np.array(draws))) > rows  # really random, not one token


def test_greedy_takes_the_argmax_with_its_logprob():
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    nxt, lp = _sample_step(logits, 0.0, None)
    np.testing.assert_array_equal(nxt, logits.argmax(1))
    ref = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    np.testing.assert_allclose(lp, ref[np.arange(4), nxt], atol=1e-6)
