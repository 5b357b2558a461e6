"""Adapters, generation and scoring on the tiny model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ppo_core.generate import decode_responses, generate, render_prompts, row_seeds
from ppo_core.models import POLICY, VALUE, ModelError, load_policy_value_model, resolve_model_dir
from ppo_core.score import score_logprobs, score_values

PROMPTS = ["Describe a rainy day.", "Hi", "Tell me what you think about waiting in long lines at the bank today."]


@pytest.fixture
def model(tiny_cfg):
    m = load_policy_value_model(tiny_cfg())
    m.reset_adapters(0)
    eos = m.eos_token_ids
    yield m
    m.eos_token_ids = eos  # the model is cached per process


def _perturb(model, adapter: str, seed: int = 1) -> None:
    flat = model.trainable(adapter)
    keys = mx.random.split(mx.random.key(seed), len(flat))
    model.assign({k: v + 0.05 * mx.random.normal(v.shape, key=key) for key, (k, v) in zip(keys, flat.items())})


def test_fresh_adapters_equal_reference(model):
    ids = render_prompts(model, PROMPTS)
    gen = generate(model, ids, adapter=None, max_new_tokens=6, temperature=1.0, seeds=row_seeds("3", range(len(ids))))
    (lp_policy, _), (lp_ref, _) = score_logprobs(
        model, ids, gen.response_ids, adapters=(POLICY, None), temperature=1.0, batch_size=8
    )
    np.testing.assert_array_equal(lp_policy, lp_ref)
    _perturb(model, POLICY)
    [(lp_policy2, _)] = score_logprobs(model, ids, gen.response_ids, adapters=(POLICY,), temperature=1.0, batch_size=8)
    assert np.abs(lp_policy2 - lp_ref).max() > 1e-3


def test_left_padding_does_not_change_greedy_output(model):
    _perturb(model, POLICY)
    ids = render_prompts(model, PROMPTS)
    batched = generate(model, ids, adapter=POLICY, max_new_tokens=8, temperature=0.0)
    for i, p in enumerate(ids):
        alone = generate(model, [p], adapter=POLICY, max_new_tokens=8, temperature=0.0)
        assert alone.response_ids[0] == batched.response_ids[i]


def test_sampling_is_keyed_by_seed(model):
    ids = render_prompts(model, PROMPTS)
    a = generate(model, ids, adapter=POLICY, max_new_tokens=8, temperature=1.0, seeds=row_seeds("5", range(len(ids))))
    b = generate(model, ids, adapter=POLICY, max_new_tokens=8, temperature=1.0, seeds=row_seeds("5", range(len(ids))))
    c = generate(model, ids, adapter=POLICY, max_new_tokens=8, temperature=1.0, seeds=row_seeds("6", range(len(ids))))
    assert a.response_ids == b.response_ids
    assert a.response_ids != c.response_ids


def test_eos_ends_a_response_and_is_kept(model):
    ids = render_prompts(model, PROMPTS)
    first = generate(model, ids, adapter=None, max_new_tokens=12, temperature=0.0)
    # declare a token the greedy model emits as EOS, so stopping is exercised for real
    stop = first.response_ids[0][3]
    model.eos_token_ids = (stop,)
    gen = generate(model, ids, adapter=None, max_new_tokens=12, temperature=0.0)
    assert gen.finish_reasons[0] == "eos"
    assert gen.response_ids[0] == first.response_ids[0][: first.response_ids[0].index(stop) + 1]
    for r, f in zip(gen.response_ids, gen.finish_reasons):
        if f == "eos":
            assert r[-1] == stop and stop not in r[:-1]
        else:
            assert len(r) == 12 and stop not in r
    texts = decode_responses(model, gen.response_ids)
    assert texts[0] == model.tokenizer.decode(gen.response_ids[0][:-1])


def test_score_matches_sampling_logprobs_and_is_padding_invariant(model):
    _perturb(model, POLICY)
    ids = render_prompts(model, PROMPTS)
    gen = generate(model, ids, adapter=POLICY, max_new_tokens=8, temperature=0.7, seeds=row_seeds("2", range(len(ids))))
    [(lp_all, ent_all)] = score_logprobs(model, ids, gen.response_ids, adapters=(POLICY,), temperature=0.7, batch_size=3)
    np.testing.assert_allclose(lp_all, np.concatenate(gen.sampling_logprobs), atol=2e-4)
    [(lp_one, ent_one)] = score_logprobs(model, ids, gen.response_ids, adapters=(POLICY,), temperature=0.7, batch_size=1)
    np.testing.assert_allclose(lp_all, lp_one, atol=2e-4)
    np.testing.assert_allclose(ent_all, ent_one, atol=2e-4)
    assert (ent_all > 0).all()
    v_all = score_values(model, ids, gen.response_ids, batch_size=3)
    v_one = score_values(model, ids, gen.response_ids, batch_size=1)
    assert v_all.shape == lp_all.shape
    np.testing.assert_allclose(v_all, v_one, atol=2e-4)


def test_adapter_save_load_round_trip(model, tmp_path):
    _perturb(model, VALUE)
    before = {k: np.array(v) for k, v in model.trainable(VALUE).items()}
    model.save_adapter(VALUE, tmp_path / "value.safetensors")
    model.reset_adapters(0)
    assert any(not np.array_equal(np.array(v), before[k]) for k, v in model.trainable(VALUE).items())
    model.load_adapter(VALUE, tmp_path / "value.safetensors")
    for k, v in model.trainable(VALUE).items():
        np.testing.assert_array_equal(np.array(v), before[k])
    assert any(k.startswith("value_head.") for k in before)
    with pytest.raises(ModelError, match="does not match"):
        model.load_adapter(POLICY, tmp_path / "value.safetensors")


def test_model_directory_errors(tmp_path, tiny_model_dir):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"), tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelError, match="missing tokenizer_config.json, model\\*.safetensors"):
        resolve_model_dir(str(broken), tmp_path)


def test_frozen_trunk_plus_adapted_top_equals_full_stack(model):
    assert model.n_frozen == 1
    _perturb(model, POLICY)
    _perturb(model, VALUE, seed=2)
    tokens = mx.array([render_prompts(model, PROMPTS[:1])[0]])
    trunk = model.trunk(tokens)
    for adapter in (None, POLICY, VALUE):
        np.testing.assert_allclose(
            np.array(model.top(trunk, adapter)), np.array(model.hidden(tokens, adapter)), atol=1e-5
        )


def test_adapter_selection_is_restored_after_each_use(model):
    """No phase leaves adapter state behind: the reference is active again after a policy block."""
    assert model.active_adapter is None
    tokens = mx.array([render_prompts(model, PROMPTS[:1])[0]])
    _perturb(model, POLICY)
    reference_before = np.array(model.hidden(tokens, None))
    with model.adapter(POLICY):
        assert model.active_adapter == POLICY
        with model.adapter(None):
            assert model.active_adapter is None
        assert model.active_adapter == POLICY
        policy_h = np.array(model.backbone(tokens))
    assert model.active_adapter is None
    assert np.abs(policy_h - reference_before).max() > 1e-4  # the block really applied the policy
    # every call that names an adapter restores the selection, also when it fails inside
    model.top(model.trunk(tokens), VALUE)
    model.hidden(tokens, POLICY)
    generate(model, [render_prompts(model, PROMPTS[:1])[0]], adapter=POLICY, max_new_tokens=2, temperature=0.0)
    assert model.active_adapter is None
    with pytest.raises(RuntimeError, match="boom"), model.adapter(VALUE):
        raise RuntimeError("boom")
    assert model.active_adapter is None
    np.testing.assert_array_equal(np.array(model.backbone(tokens)), reference_before)
    with pytest.raises(ValueError, match="unknown adapter 'critic'"), model.adapter("critic"):
        pass


def test_a_model_cache_is_owned_by_its_caller(tiny_cfg):
    from ppo_core.models import MODELS, ModelCache

    cfg = tiny_cfg()
    shared = load_policy_value_model(cfg)
    assert load_policy_value_model(cfg) is shared  # the process default loads once
    own = ModelCache()
    private = load_policy_value_model(cfg, own)
    assert private is not shared and own.get(cfg) is private and len(own) == 1
    own.clear()
    assert len(own) == 0 and own.get(cfg) is not private
    assert MODELS.get(cfg) is shared  # clearing one cache leaves the others alone
