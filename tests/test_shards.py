"""Data-parallel phases on shards (tiny model, no Prefect): same tokens, same tables, reused like phases."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import polars as pl
import pytest

from ppo_core import phases as P
from ppo_core import pipeline
from ppo_core.pipeline import Runner

SHARDED_TABLES = ("rollouts", "sa_pairs", "values", "eval")


def _cfg(tiny_cfg, root):
    return tiny_cfg(artifact_root=root, batch_size=7, eval_size=5)


def _digest(cfg) -> dict[str, str]:
    files = sorted(p for p in cfg.layout.run_dir.rglob("*") if p.suffix in (".parquet", ".safetensors"))
    return {str(p.relative_to(cfg.layout.run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def whole_and_sharded(tiny_cfg, tmp_path):
    whole, sharded = _cfg(tiny_cfg, tmp_path / "whole"), _cfg(tiny_cfg, tmp_path / "sharded")
    pipeline.run(whole, 2)
    pipeline.run(sharded, 2, Runner(shards=3))
    return whole, sharded


def test_shard_rows_cover_the_batch_once():
    for n in (1, 5, 7, 64):
        for count in range(1, min(n, 6) + 1):
            rows = np.concatenate([s.rows(n) for s in P.Shard.split(count)])
            assert rows.tolist() == list(range(n))
    with pytest.raises(ValueError, match="shard index 3 is outside 0..2"):
        P.Shard(3, 3)


def test_sharded_phases_sample_and_score_what_one_process_does(whole_and_sharded):
    whole, sharded = whole_and_sharded
    for it in (1, 2):
        a = {t: pl.read_parquet(whole.layout.table(it, t)) for t in SHARDED_TABLES}
        b = {t: pl.read_parquet(sharded.layout.table(it, t)) for t in SHARDED_TABLES}
        # randomness is keyed per rollout id: the same tokens, whatever the shards
        assert a["rollouts"]["response_token_ids"].to_list() == b["rollouts"]["response_token_ids"].to_list()
        assert a["rollouts"]["seed"].to_list() == b["rollouts"]["seed"].to_list()
        assert a["rollouts"]["rollout_id"].to_list() == list(range(whole.batch_size))
        # teacher-forced numbers agree up to the rounding of differently padded batches
        for table, cols in (("sa_pairs", ("logprob", "ref_logprob", "kl", "entropy")), ("values", ("value",))):
            assert a[table].select("rollout_id", "t").equals(b[table].select("rollout_id", "t"))
            for col in cols:
                np.testing.assert_allclose(a[table][col].to_numpy(), b[table][col].to_numpy(), atol=1e-5, err_msg=col)
        np.testing.assert_allclose(
            np.concatenate(a["rollouts"]["sampling_logprobs"].to_list()),
            np.concatenate(b["rollouts"]["sampling_logprobs"].to_list()), atol=1e-5,
        )
        assert a["eval"].select("prompt_id", "response").equals(b["eval"].select("prompt_id", "response"))
        np.testing.assert_allclose(a["eval"]["score"].to_numpy(), b["eval"]["score"].to_numpy(), atol=1e-6)
    # each shard wrote its own part; the merged table is what every reader sees
    parts = sorted(p.parent.name for p in sharded.layout.run_dir.glob("iter=0001/parts/*/rollouts.parquet"))
    assert parts == ["part-0-of-3", "part-1-of-3", "part-2-of-3"]


def test_same_shard_count_same_bytes(whole_and_sharded, tiny_cfg, tmp_path):
    _, sharded = whole_and_sharded
    again = _cfg(tiny_cfg, tmp_path / "again")
    pipeline.run(again, 2, Runner(shards=3))
    assert _digest(again) == _digest(sharded)


def test_a_finished_phase_is_reused_whatever_the_shard_count(whole_and_sharded):
    whole, sharded = whole_and_sharded
    # a run finished unsharded is reused entirely by a sharded runner, and the reverse
    assert all(r["cached"] for r in pipeline.run_iteration(whole, 2, Runner(shards=3)))
    assert all(r["cached"] for r in pipeline.run_iteration(sharded, 2, Runner()))
    assert not list(whole.layout.run_dir.glob("iter=*/parts"))


def test_a_merge_lost_before_it_finished_reuses_every_finished_shard(whole_and_sharded):
    _, sharded = whole_and_sharded
    before = _digest(sharded)
    sa_pairs = sharded.layout.table(2, "sa_pairs")
    sa_pairs.unlink()  # as if the process died between the last shard and the merge
    calls: list[str] = []

    class Recording(Runner):
        def call(self, fn, cfg, *args, **kwargs):
            result = super().call(fn, cfg, *args, **kwargs)
            calls.append(f"{result['phase']}:{'cached' if result['cached'] else 'computed'}")
            return result

    results = pipeline.run_iteration(sharded, 2, Recording(shards=3))
    assert calls.count("attribute:computed") == 1  # the merge: the only work redone
    slowest = max(json.loads(sharded.layout.phase_record(2, f"attribute.part-{i}-of-3").read_text())["seconds"]
                  for i in range(3))
    assert results[1]["seconds"] >= slowest  # the phase's time counts the reused shards' own
    assert [c for c in calls if c.startswith("attribute.part")] == [f"attribute.part-{i}-of-3:cached" for i in range(3)]
    assert _digest(sharded) == before


def test_more_shards_than_held_out_prompts(tiny_cfg, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"prompt_id": "e0", "prompt": "Hi"}\n{"prompt_id": "e1", "prompt": "Tell me a joke."}\n')
    cfg = tiny_cfg(eval_prompts_path=prompts, eval_size=32)
    result = pipeline.start(cfg, Runner(shards=3))[1]
    assert result["phase"] == "evaluate"
    assert pl.read_parquet(result["outputs"]["eval"])["prompt_id"].to_list() == ["e0", "e1"]
