"""Learned reward model: Bradley-Terry training, saving, and use as PPO's reward."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import polars as pl
import pytest

from ppo_core import phases as P
from ppo_core.config import PROJECT_ROOT, ConfigError, RewardModelSettings
from ppo_core.layout import models_dir, reward_model_path, reward_model_sidecar
from ppo_core.models import ModelError, load_policy_value_model
from ppo_core.reward_model import (
    LearnedReward,
    PreferenceError,
    load_preferences,
    pairwise_accuracy,
    score_ids,
    score_texts,
    split_pairs,
    train_from_file,
)
from ppo_core.rewards import VaderSentiment
from ppo_core.runs import check_inputs

TOPICS = ["the bus", "my job", "rain", "the city", "dinner", "school", "my phone", "the park", "winter",
          "traffic", "coffee", "the beach", "homework", "my dog", "the train", "music", "the gym", "a movie"]


def _pairs(path):
    rows = [{"prompt": f"Tell me about {t}.", "chosen": f"I love {t}, it is great and wonderful.",
             "rejected": f"I hate {t}, it is awful and terrible."} for t in TOPICS]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def trained(tiny_cfg, tmp_path):
    cfg = tiny_cfg()
    settings = RewardModelSettings(data=_pairs(tmp_path / "prefs.jsonl"), name="tiny-rm", epochs=8, lr=3e-3, batch_size=4,
                                   eval_fraction=0.25)
    result = train_from_file(cfg, settings)
    return cfg, result


def test_bradley_terry_learns_and_generalises_to_held_out_prompts(trained):
    cfg, result = trained
    assert result["train_pairs"] + result["eval_pairs"] == len(TOPICS) and result["eval_pairs"] >= 4
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < 0.5 * losses[0]
    assert result["eval_accuracy"] >= 0.9
    meta = json.loads(reward_model_sidecar(reward_model_path(cfg.artifact_root, "tiny-rm")).read_text())
    assert meta["lora_layers"] == str(cfg.lora_layers) and float(meta["score_std"]) > 0


def test_learned_reward_in_the_reward_phase(trained, tiny_cfg):
    cfg, result = trained
    run_cfg = tiny_cfg(run="rm-run", reward=f"model:{result['path']}", reward_norm="batch")
    check_inputs(run_cfg)
    P.init_checkpoint(run_cfg)
    ck = run_cfg.layout.checkpoint(0)
    ro = P.rollout(run_cfg, 1, ck)
    sa = P.attribute(run_cfg, 1, ro.path("rollouts"), ck)
    rw = P.reward(run_cfg, 1, ro.path("rollouts"), sa.path("sa_pairs"))
    final = pl.read_parquet(rw.path("rewards")).group_by("rollout_id").agg(pl.col("score").sum())
    raw = final["score"].to_numpy() - run_cfg.missing_eos_penalty * np.array(
        [f == "length" for f in pl.read_parquet(ro.path("rollouts")).sort("rollout_id")["finish_reason"]]
    )[final["rollout_id"].to_numpy()]
    assert abs(raw.mean()) < 1e-5 and abs(raw.std() - 1.0) < 1e-3  # batch-normalised
    # the reward model's bytes are part of the phase's cache key
    assert P.reward(run_cfg, 1, ro.path("rollouts"), sa.path("sa_pairs")).cached


def test_reward_phase_scores_the_generated_tokens_not_a_re_encoding(trained, tiny_cfg):
    """A response cut at the length limit is scored as cut: no EOS appended, no decode/encode round trip."""
    cfg, result = trained
    run_cfg = tiny_cfg(run="rm-ids", reward=f"model:{result['path']}", missing_eos_penalty=0.0)
    P.init_checkpoint(run_cfg)
    ck = run_cfg.layout.checkpoint(0)
    ro = P.rollout(run_cfg, 1, ck)
    sa = P.attribute(run_cfg, 1, ro.path("rollouts"), ck)
    rw = P.reward(run_cfg, 1, ro.path("rollouts"), sa.path("sa_pairs"))
    stored = pl.read_parquet(rw.path("rewards")).group_by("rollout_id").agg(pl.col("score").sum()).sort("rollout_id")["score"]
    rollouts = pl.read_parquet(ro.path("rollouts")).sort("rollout_id")
    model = load_policy_value_model(run_cfg)  # the reward phase loaded the reward adapter into it
    ids = rollouts["prompt_token_ids"].to_list(), rollouts["response_token_ids"].to_list()
    expected = score_ids(model, *ids, batch_size=4)
    np.testing.assert_allclose(stored.to_numpy(), expected, atol=1e-5)
    cut = (rollouts["finish_reason"] == "length").to_numpy()
    assert cut.any()
    with_eos = score_texts(model, rollouts["prompt"].to_list(), rollouts["response"].to_list(), 4)
    assert np.abs(with_eos[cut] - expected[cut]).max() > 1e-4  # what the old re-encoding + EOS would have scored


def test_learned_reward_orders_texts_and_checks_its_layout(trained, tiny_cfg, tmp_path):
    cfg, result = trained
    fn = LearnedReward(load_policy_value_model(cfg), result["path"], cfg)
    good, bad = fn(["Tell me about the sea."] * 2, ["I love the sea, it is great and wonderful.",
                                                   "I hate the sea, it is awful and terrible."], np.array([9, 9]))
    assert good > bad
    with pytest.raises(ModelError, match="different LoRA layout: lora_rank 8 \\(run uses 4\\)"):
        other = tiny_cfg(lora_rank=4)
        LearnedReward(load_policy_value_model(other), result["path"], other)
    weights, meta = mx.load(str(result["path"]), return_metadata=True)
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), weights, metadata={**meta, "model_dir": "llama-70b"})
    with pytest.raises(ModelError, match="trained on base model 'llama-70b', but this run uses 'tiny'"):
        LearnedReward(load_policy_value_model(cfg), foreign, cfg)


def test_missing_reward_model_and_bad_preference_files(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="reward model file .*nope.safetensors does not exist"):
        check_inputs(tiny_cfg(reward=f"model:{tmp_path / 'nope.safetensors'}"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "chosen": "y"}\n{"prompt": "z", "chosen": "w"}\n')
    with pytest.raises(PreferenceError, match="lacks column\\(s\\) \\['rejected'\\]"):
        load_preferences(bad)
    with pytest.raises(PreferenceError, match="does not exist"):
        load_preferences(tmp_path / "missing.jsonl")


def test_split_holds_out_whole_prompts():
    df = pl.DataFrame({"prompt": [f"p{i // 3}" for i in range(30)], "chosen": ["a"] * 30, "rejected": ["b"] * 30})
    train, held = split_pairs(df, 0.2, seed=1)
    assert train.height + held.height == 30
    assert not set(train["prompt"]) & set(held["prompt"])
    assert held["prompt"].n_unique() == 2


def test_shipped_preferences_follow_their_label_rule():
    df = load_preferences(PROJECT_ROOT / "data" / "preferences.jsonl")
    assert df.height >= 150 and df["prompt"].n_unique() >= 50
    vader = VaderSentiment()
    chosen = vader(df["prompt"].to_list(), df["chosen"].to_list(), None)
    rejected = vader(df["prompt"].to_list(), df["rejected"].to_list(), None)
    assert (chosen - rejected >= 0.3 - 1e-9).all()


@pytest.mark.slow
def test_reward_model_on_smollm2_beats_chance_on_held_out_pairs(tmp_path):
    from ppo_core.config import PPOConfig

    models = models_dir(tmp_path / "artifacts")
    models.parent.mkdir(parents=True)
    models_dir(PROJECT_ROOT / "artifacts").mkdir(parents=True, exist_ok=True)
    models.symlink_to(models_dir(PROJECT_ROOT / "artifacts").resolve(), target_is_directory=True)
    cfg = PPOConfig(artifact_root=tmp_path / "artifacts")
    result = train_from_file(cfg, RewardModelSettings(data=PROJECT_ROOT / "data" / "preferences.jsonl", name="smol-rm"))
    assert result["eval_pairs"] >= 30
    assert result["eval_accuracy"] >= 0.65, result["history"]
    model = load_policy_value_model(cfg)
    held = split_pairs(load_preferences(PROJECT_ROOT / "data" / "preferences.jsonl"), 0.2, cfg.seed)[1]
    assert pairwise_accuracy(model, held, cfg.score_batch_size) == pytest.approx(result["eval_accuracy"])
