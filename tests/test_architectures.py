"""Every supported architecture: the split forward pass PPO scores with is the model's own.

For tiny random models of each type (written as real model directories):
full forward == top(trunk()), with and without an adapter; the padded batch
the scoring and training passes use == each sequence's own full forward; and
the logprobs the sampler drew tokens with == the logprobs scoring assigns them.
Anything else is refused at load with the type named.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from ppo_core.config import PPOConfig
from ppo_core.generate import generate, render_prompts
from ppo_core.models import POLICY, SUPPORTED_MODEL_TYPES, ModelCache, ModelError
from ppo_core.score import make_batch, score_logprobs, token_logprobs
from ppo_core.tiny import make_tiny_model

PROMPTS = ["Tell me about rivers.", "Hi", "Write a short, cheerful note to a friend about the weather today."]


@pytest.fixture(scope="module", params=SUPPORTED_MODEL_TYPES)
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", seed=3, layers=3, model_type=request.param)
    cfg = PPOConfig(model=str(path), artifact_root=tmp_path_factory.mktemp("art"), lora_layers=2, batch_size=4, num_minibatches=2)
    m = ModelCache().get(cfg)
    # a non-zero policy adapter, so that "with the adapter" differs from the reference
    keys = mx.random.split(mx.random.key(7), len(m.trainable(POLICY)))
    m.assign({k: 0.05 * mx.random.normal(v.shape, key=key) for key, (k, v) in zip(keys, sorted(m.trainable(POLICY).items()))})
    assert json.loads((path / "config.json").read_text())["model_type"] == request.param
    return m


def _full_forward_logprobs(model, tokens: list[int], adapter) -> np.ndarray:
    with model.adapter(adapter):
        logits = model.lm(mx.array([tokens]))[0]
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("adapter", [None, POLICY])
def test_full_forward_equals_top_of_trunk(model, adapter):
    tokens = render_prompts(model, PROMPTS[2:])[0]
    split = model.logits_from_hidden(model.top(model.trunk(mx.array([tokens])), adapter))[0]
    split = np.array(split - mx.logsumexp(split, axis=-1, keepdims=True))
    np.testing.assert_allclose(split, _full_forward_logprobs(model, tokens, adapter), atol=2e-5)


def test_adapter_changes_the_output(model):
    tokens = render_prompts(model, PROMPTS[:1])[0]
    assert np.abs(_full_forward_logprobs(model, tokens, POLICY) - _full_forward_logprobs(model, tokens, None)).max() > 1e-3


def test_padded_batch_equals_each_sequence_alone(model):
    """The right-padded batch of scoring and training against one full forward per sequence."""
    prompts = render_prompts(model, PROMPTS)
    rng = np.random.default_rng(0)
    responses = [rng.integers(10, 300, n).tolist() for n in (5, 1, 9)]
    batch = make_batch(prompts, responses, model.pad_token_id)
    lp, _ = token_logprobs(model, batch, POLICY, temperature=1.0, with_entropy=False)
    lp = np.array(lp)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        full = _full_forward_logprobs(model, p + r, POLICY)
        expected = full[np.arange(len(p) - 1, len(p) - 1 + len(r)), r]
        np.testing.assert_allclose(lp[i, : len(r)], expected, atol=2e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_scoring_logprobs(model, temperature):
    """Left-padded KV-cached sampling and right-padded scoring agree on every drawn token."""
    prompts = render_prompts(model, PROMPTS)
    gen = generate(model, prompts, adapter=POLICY, max_new_tokens=8, temperature=temperature, seeds=[1, 2, 3])
    [(scored, _)] = score_logprobs(
        model, prompts, gen.response_ids, adapters=(POLICY,), temperature=temperature, batch_size=2, entropy=(False,)
    )
    np.testing.assert_allclose(scored, np.concatenate(gen.sampling_logprobs), atol=1e-4)


def test_an_unverified_architecture_is_refused_by_name(tmp_path, tiny_model_dir):
    gemma = tmp_path / "gemma"
    shutil.copytree(tiny_model_dir, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    cfg = PPOConfig(model=str(gemma), artifact_root=tmp_path / "art", batch_size=4, num_minibatches=2)
    with pytest.raises(ModelError, match=r"model type 'gemma2' .* not supported.*llama, mistral, qwen2, qwen3"):
        ModelCache().get(cfg)
