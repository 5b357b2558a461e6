"""The real SmolLM2-135M-Instruct: conversion correctness and one PPO iteration via the flow."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import polars as pl
import pytest

from ppo_core.config import PROJECT_ROOT, PPOConfig
from ppo_core.generate import decode_responses, generate, render_prompts
from ppo_core.layout import models_dir
from ppo_core.models import load_policy_value_model
from ppo_core.score import make_batch, token_logprobs

pytestmark = pytest.mark.slow

# The converted model is cached in the project's artifact root, like a user's.
MODEL_ROOT = PROJECT_ROOT / "artifacts"

ENGLISH = "The weather was lovely today, so we walked to the park and had a picnic by the lake."
SCRAMBLED = "lake lovely picnic the park walked so by had we to today, weather a the and was The."


@pytest.fixture(scope="module")
def smollm2():
    model = load_policy_value_model(PPOConfig(artifact_root=MODEL_ROOT))
    model.reset_adapters(0)
    return model


def _nll_per_token(model, text: str) -> float:
    ids = model.tokenizer.encode(text)
    b = make_batch([ids[:1]], [ids[1:]], model.pad_token_id)
    lp, _ = token_logprobs(model, b, None, 1.0)
    return -float(mx.mean(lp).item())


def _conditional_nll(model, prompts: list[list[int]], responses: list[list[int]]) -> float:
    b = make_batch(prompts, responses, model.pad_token_id)
    lp, _ = token_logprobs(model, b, None, 1.0, with_entropy=False)
    mask = np.array(b.mask)
    return -float((np.array(lp) * mask).sum() / mask.sum())


def test_conversion_gives_a_fluent_model(smollm2):
    # a correctly converted LM finds English far likelier than the same words scrambled
    english, scrambled = _nll_per_token(smollm2, ENGLISH), _nll_per_token(smollm2, SCRAMBLED)
    assert english < 3.5, english
    assert scrambled > english + 1.5, (english, scrambled)
    prompts = ["Describe a rainy Monday morning in two sentences.", "What is the capital of France?"]
    gen = generate(smollm2, render_prompts(smollm2, prompts), adapter=None, max_new_tokens=40, temperature=0.0)
    texts = decode_responses(smollm2, gen.response_ids)
    assert "rain" in texts[0].lower()
    assert "paris" in texts[1].lower()
    for t in texts:
        words = t.split()
        assert len(words) >= 5 and t.isascii()


def test_tokenizer_round_trips_and_uses_the_chat_template(smollm2):
    tok = smollm2.tokenizer
    text = "Hello world 123, it's a test: naïve café!"
    assert tok.decode(tok.encode(text)) == text
    ids = render_prompts(smollm2, ["Hi"])[0]
    rendered = tok.decode(ids)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(list(smollm2.eos_token_ids)) == ["<|im_end|>"]


@pytest.mark.usefixtures("prefect_server")
def test_one_iteration_of_the_flow_on_smollm2(tmp_path):
    from flows.ppo import ppo
    from ppo_core import track
    from ppo_core.query import connect

    models = models_dir(tmp_path / "artifacts")
    models.parent.mkdir(parents=True)
    models_dir(MODEL_ROOT).mkdir(parents=True, exist_ok=True)
    models.symlink_to(models_dir(MODEL_ROOT).resolve(), target_is_directory=True)
    overrides = {
        "artifact_root": str(tmp_path / "artifacts"), "batch_size": 4, "max_new_tokens": 16,
        "eval_size": 4, "eval_max_new_tokens": 16, "ppo_epochs": 1, "num_minibatches": 2,
    }
    ppo(run="e2e", iterations=1, overrides=overrides)
    cfg = PPOConfig(run="e2e", **overrides)
    con = connect(cfg.artifact_root)
    n_tokens = con.sql("select sum(len(response_token_ids)) from rollouts").fetchall()[0][0]
    for table in ("sa_pairs", "rewards", "advantages"):
        assert con.sql(f"select count(*) from {table} where iter = 1").fetchall()[0][0] == n_tokens
    rollouts = con.sql("select prompt_token_ids, response_token_ids, response from rollouts").pl()
    assert all(r.strip() for r in rollouts["response"])
    # responses are fluent: given its prompt, the reference model finds each response far likelier
    # than the same tokens in a shuffled order (sampling at T=1 keeps the absolute NLL noisy)
    model = load_policy_value_model(cfg)
    prompts = [list(p) for p in rollouts["prompt_token_ids"]]
    responses = [list(r) for r in rollouts["response_token_ids"]]
    rng = np.random.default_rng(0)
    shuffled = [list(rng.permutation(r)) for r in responses]
    nll, nll_shuffled = (_conditional_nll(model, prompts, rs) for rs in (responses, shuffled))
    assert nll < 4.5 and nll_shuffled > nll + 1.0, (nll, nll_shuffled, rollouts["response"].to_list())
    history = track.run_metrics(cfg)
    assert [s for s, _ in history["reward/score"]] == [1]
    assert all(math.isfinite(v) for _, v in history["train/policy_loss"])
    kl = pl.from_arrow(con.sql("select kl from sa_pairs").arrow())["kl"]
    assert kl.abs().max() == 0.0  # iteration 1 samples from the untouched policy
