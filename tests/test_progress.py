"""A long phase reports done / total, rate and ETA while it runs: rollout and evaluation in tokens, training in steps."""

from __future__ import annotations

import logging

import pytest

from ppo_core import pipeline, progress


def test_a_report_logs_at_most_every_interval_and_nothing_without_one(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ppo_core.progress")
    progress.advance(5)  # no report open: nothing happens
    clock = iter([0.0, 0.0, 1.0, 6.0, 7.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.report("rollout", 100, "tokens"):
        progress.advance(10)  # t=1: too soon
        progress.advance(20)  # t=6: 30 tokens in 6 s, 70 left
        progress.advance(10)  # t=7: too soon after the last line
    assert [r.getMessage() for r in caplog.records] == ["rollout: 30/100 tokens (30%), 5.0 tokens/s, ETA 14 s"]


def test_rollout_training_and_evaluation_report_progress(tiny_cfg, monkeypatch, caplog):
    monkeypatch.setattr(progress, "EVERY_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger="ppo_core.progress")
    cfg = tiny_cfg()
    pipeline.run(cfg, 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "ppo_core.progress"]
    steps = cfg.ppo_epochs * cfg.num_minibatches
    assert f"training: {steps}/{steps} steps (100%)" in "\n".join(lines)
    assert any(line.startswith(f"rollout of iteration 1: ") and f"/{cfg.batch_size * cfg.max_new_tokens} tokens" in line for line in lines)
    assert any(line.startswith("evaluation of iteration 1: ") for line in lines)
    assert all("tokens/s" in line or "steps/s" in line for line in lines)
