"""Data-parallel training on mx.distributed ranks (tiny model, ranks as local processes)."""

from __future__ import annotations

import shutil

import numpy as np
import polars as pl
import pytest
from safetensors.numpy import load_file

from ppo_core import phases as P
from ppo_core import pipeline
from ppo_core.config import ConfigError
from ppo_core.ranks import check_ranks
from ppo_core.models import PPO_ADAPTERS
from ppo_core.pipeline import Runner
from ppo_core.train import TrainingError


@pytest.fixture
def trained_once(tiny_cfg):
    cfg = tiny_cfg(batch_size=8, eval_size=0)
    pipeline.run(cfg, 1)
    return cfg


def _adapters(cfg, iteration):
    return {a: load_file(cfg.layout.checkpoint(iteration).adapter(a)) for a in PPO_ADAPTERS}


def _retrain(cfg, runner: Runner) -> dict:
    """Train iteration 1 again on the same tables (its checkpoint, metrics and record removed)."""
    shutil.rmtree(cfg.layout.checkpoint(1).dir, ignore_errors=True)
    cfg.layout.table(1, "metrics").unlink(missing_ok=True)
    cfg.layout.phase_record(1, "train").unlink(missing_ok=True)
    t = lambda name: cfg.layout.table(1, name)  # noqa: E731
    return runner.call(P.train, cfg, 1, t("rollouts"), t("sa_pairs"), t("advantages"), cfg.layout.checkpoint(0),
                       **runner.train_options())


def test_two_ranks_train_what_one_process_does(trained_once):
    cfg = trained_once
    one, m_one = _adapters(cfg, 1), pl.read_parquet(cfg.layout.table(1, "metrics"))
    result = _retrain(cfg, Runner(train_ranks=2))
    assert not result["cached"]
    two, m_two = _adapters(cfg, 1), pl.read_parquet(cfg.layout.table(1, "metrics"))
    for adapter in PPO_ADAPTERS:
        assert one[adapter].keys() == two[adapter].keys()
        for name in one[adapter]:
            np.testing.assert_allclose(one[adapter][name], two[adapter][name], atol=1e-5, err_msg=f"{adapter} {name}")
    assert any(np.abs(one["policy"][k]).max() > 0 for k in one["policy"] if k.endswith(".b"))  # it did train
    # norms and fractions are of the whole minibatch, not of one rank's half
    for col in ("policy_grad_norm", "value_grad_norm", "policy_loss", "value_loss", "approx_kl", "clip_fraction"):
        np.testing.assert_allclose(m_one[col].to_numpy(), m_two[col].to_numpy(), rtol=1e-4, atol=1e-6, err_msg=col)


def test_a_rank_that_dies_fails_the_phase_and_a_rerun_resumes(trained_once, monkeypatch):
    cfg = trained_once
    monkeypatch.setenv("PPO_KILL_AT", "train.step:2")
    monkeypatch.setenv("PPO_KILL_RANK", "1")
    with pytest.raises(TrainingError, match=r"training rank \d of 2 exited with code -?\d+; the other ranks were stopped"):
        _retrain(cfg, Runner(train_ranks=2))
    assert not cfg.layout.checkpoint(1).dir.exists() and not cfg.layout.table(1, "metrics").exists()
    monkeypatch.delenv("PPO_KILL_AT")
    assert not pipeline.run_iteration(cfg, 1, Runner(train_ranks=2))[5]["cached"]  # train reruns; the rest is reused
    assert cfg.layout.checkpoint(1).adapter("policy").is_file()


def test_more_ranks_than_rollouts_per_minibatch_is_refused(trained_once):
    with pytest.raises(ConfigError, match="train_ranks=5 is more than the 4 rollouts of the smallest minibatch"):
        _retrain(trained_once, Runner(train_ranks=5))


def test_the_ranks_check_counts_every_sample_of_a_prompt(tiny_cfg):
    """8 prompts x 4 samples in 16 minibatches: 2 rollouts each, so 2 ranks fit and 3 do not."""
    cfg = tiny_cfg(batch_size=8, samples_per_prompt=4, num_minibatches=16, advantage_estimator="rloo")
    check_ranks(cfg, 2)
    with pytest.raises(ConfigError, match=r"more than the 2 rollouts .*samples_per_prompt 4"):
        check_ranks(cfg, 3)
