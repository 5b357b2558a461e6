"""The chunked vocabulary head against MLX's own log-softmax and autograd.

Scoring (``flat_logprobs``, NumPy statistics) and training (``PPOStep``'s
gradient through ``token_stats``'s custom VJP) must give the logprobs, entropies and gradients that the plain MLX
expression gives, at several temperatures, with chunks smaller than the batch,
for a tied and an untied head.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ppo_core import vocab_head
from ppo_core.config import PPOConfig
from ppo_core.losses import policy_loss
from ppo_core.train import Minibatch, PPOStep, TrainSettings, _dot, make_optimizer
from ppo_core.models import POLICY, ModelCache
from ppo_core.score import TRUNKS, TrunkCache, flat_logprobs, make_batch, token_logprobs
from ppo_core.tiny import make_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # tied and untied heads
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", seed=5, layers=3, model_type=request.param)
    cfg = PPOConfig(model=str(path), artifact_root=tmp_path_factory.mktemp("art"), lora_layers=2, batch_size=4)
    m = ModelCache().get(cfg)
    keys = mx.random.split(mx.random.key(11), len(m.trainable(POLICY)))
    m.assign({k: 0.05 * mx.random.normal(v.shape, key=key) for key, (k, v) in zip(keys, sorted(m.trainable(POLICY).items()))})
    return m


def _batch(model, seed=0):
    rng = np.random.default_rng(seed)
    vocab = model.head_weight.shape[0]
    prompts = [list(rng.integers(3, vocab, n)) for n in (5, 9, 3, 7)]
    responses = [list(rng.integers(3, vocab, n)) for n in (6, 1, 11, 4)]
    return make_batch(prompts, responses, model.pad_token_id)


def _reference(model, batch, adapter, temperature):
    """The plain MLX expression: full logits, log-softmax, entropy, on the (B, T) grid."""
    h = model.top(model.trunk(batch.tokens), adapter)
    h = mx.take_along_axis(h, batch.positions[..., None], axis=1)
    logits = model.logits_from_hidden(h) / temperature
    lse = mx.logsumexp(logits, axis=-1)
    lp = mx.take_along_axis(logits, batch.targets[..., None], axis=-1)[..., 0] - lse
    ent = lse - (mx.softmax(logits, axis=-1) * logits).sum(axis=-1)
    return lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_scoring_matches_mlx_log_softmax(model, temperature, monkeypatch):
    monkeypatch.setattr(vocab_head, "CHUNK_ROWS", 5)  # several chunks, one ragged
    batch = _batch(model)
    lp, ent = flat_logprobs(model, batch, POLICY, temperature, model.trunk(batch.tokens), True)
    ref_lp, ref_ent = _reference(model, batch, POLICY, temperature)
    real = np.array(batch.mask) > 0
    assert lp.shape == (batch.n_tokens,) == (int(real.sum()),)
    np.testing.assert_allclose(lp, np.array(ref_lp)[real], atol=2e-5)
    np.testing.assert_allclose(ent, np.array(ref_ent)[real], atol=2e-5)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_training_gradient_matches_mlx_autograd(model, entropy_coef, monkeypatch):
    """PPOStep's policy gradient (chunked head with its own VJP) against MLX's autograd of the plain expression."""
    monkeypatch.setattr(vocab_head, "CHUNK_ROWS", 7)
    batch = _batch(model, seed=1)
    trunk = model.trunk(batch.tokens)
    rng = np.random.default_rng(2)
    old = mx.array(rng.normal(-4, 1, batch.mask.shape).astype(np.float32))
    adv = mx.array(rng.normal(0, 1, batch.mask.shape).astype(np.float32))
    settings = TrainSettings(epochs=1, num_minibatches=1, clip_range=0.2, value_clip_range=0.2,
                             entropy_coef=entropy_coef, max_grad_norm=1.0, temperature=0.8, adapters=(POLICY,))
    step = PPOStep(model, settings, {POLICY: make_optimizer(1e-3)})
    zeros = mx.zeros(batch.mask.shape)
    mb = Minibatch(batch, trunk, old, adv, zeros, zeros, "test")
    stats, ours = step.gradient(POLICY, mb)

    def reference(p):
        model.assign(_dot(p))
        lp, ent = _reference(model, batch, POLICY, 0.8)
        return policy_loss(lp, old, adv, batch.mask, 0.2, ent if entropy_coef > 0 else None, entropy_coef)

    (_, ref_stats), ref = mx.value_and_grad(reference)(step.params[POLICY])
    assert abs(stats["policy_loss"].item() - ref_stats["policy_loss"].item()) < 1e-5
    scale = max(float(mx.abs(g).max()) for g in ref.values())
    assert scale > 1e-4  # the gradient is not trivially zero
    assert set(ours) == set(ref)
    for k in ref:
        np.testing.assert_allclose(np.array(ours[k]), np.array(ref[k]), atol=1e-4 * scale, err_msg=k)


@pytest.mark.parametrize("entropy", [False, True])
def test_token_stats_of_no_tokens_and_its_gradient(model, entropy):
    h = mx.zeros((0, model.head_weight.shape[1]))

    def total(x):
        lp, ent = vocab_head.token_stats(model, x, np.zeros(0, np.int32), 1.0, entropy=entropy)
        assert lp.shape == (0,) and (ent is None) == (not entropy)
        return lp.sum() + (ent.sum() if entropy else 0.0)

    value, grad = mx.value_and_grad(total)(h)
    assert value.item() == 0.0 and grad.shape == h.shape


def test_padding_cells_are_zero(model):
    batch = _batch(model, seed=3)
    lp, ent = token_logprobs(model, batch, POLICY, 1.0, None, True)
    pad = np.array(batch.mask) == 0
    assert pad.any() and (np.array(lp)[pad] == 0).all() and (np.array(ent)[pad] == 0).all()


def test_trunk_cache_reuses_one_pass_per_token_batch(model):
    cache = TrunkCache()
    batch, other = _batch(model), _batch(model, seed=9)
    first = cache.get(model, batch.tokens)
    assert cache.get(model, batch.tokens) is first and (cache.hits, cache.misses) == (1, 1)
    np.testing.assert_array_equal(np.array(first), np.array(model.trunk(batch.tokens)))
    cache.get(model, other.tokens)  # a different batch misses and replaces it
    assert cache.misses == 2 and cache.get(model, batch.tokens) is not first
    assert TRUNKS.size == 1  # the process's cache holds one batch: the memory estimate's training trunk


def test_one_trunk_pass_serves_attribute_value_and_train(tiny_cfg):
    """In one process an iteration computes the frozen layers over its rollouts once."""
    from ppo_core import pipeline

    cfg = tiny_cfg()
    pipeline.start(cfg)
    hits, misses = TRUNKS.hits, TRUNKS.misses
    pipeline.run_iteration(cfg, 1)
    assert (TRUNKS.hits - hits, TRUNKS.misses - misses) == (2, 1)  # attribute computes; value and train reuse


def test_trunk_cache_never_serves_another_models_activations(model):
    """A model freed and another loaded at the same address (same id()) must not get the old trunk."""
    cache = TrunkCache()
    batch = _batch(model)
    first = cache.get(model, batch.tokens)
    key = next(iter(cache._entries))
    cache._entries[key] = (lambda: None, first)  # what a freed model's weak reference returns
    assert cache.get(model, batch.tokens) is not first and cache.misses == 2
