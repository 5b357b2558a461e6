"""Each bad input or fault gets a clear error and loses nothing already written."""

from __future__ import annotations

import errno

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_core import phases as P
from ppo_core.config import ConfigError
from ppo_core.models import ModelError, load_policy_value_model
from ppo_core.rewards import RewardError
from ppo_core.runs import check_inputs
from ppo_core.tables import ArtifactWriteError, sha256_file, write_table
from ppo_core.train import TrainingError


def _through_attribute(cfg):
    P.init_checkpoint(cfg)
    ck = cfg.layout.checkpoint(0)
    ro = P.rollout(cfg, 1, ck)
    sa = P.attribute(cfg, 1, ro.path("rollouts"), ck)
    return ck, ro, sa


def _snapshot(cfg) -> dict[str, str]:
    return {str(p): sha256_file(p) for p in cfg.layout.run_dir.rglob("*") if p.is_file()}


def test_corrupt_model_directory(tiny_cfg, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match="cannot load model directory"):
        load_policy_value_model(tiny_cfg(model=str(broken)))


def test_batch_larger_than_prompt_set(tiny_cfg, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(ConfigError, match="'batch_size': 6 is larger than the prompt set \\(2 prompts"):
        check_inputs(tiny_cfg(prompts_path=prompts))


def test_artifact_root_that_cannot_be_created(tiny_cfg, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="artifact root .* cannot be created"):
        check_inputs(tiny_cfg(artifact_root=blocker / "artifacts"))


@pytest.mark.parametrize("bad", ["nan", "raise"])
def test_broken_reward_function_fails_the_phase_and_keeps_earlier_tables(tiny_cfg, monkeypatch, bad):
    cfg = tiny_cfg()
    _, ro, sa = _through_attribute(cfg)
    before = _snapshot(cfg)

    class Broken:
        name = "broken"

        def __call__(self, prompts, responses, n_tokens):
            if bad == "raise":
                raise ValueError("lexicon missing")
            return np.full(len(responses), np.nan)

    monkeypatch.setattr(P, "make_reward", lambda *a, **k: Broken())
    msg = "raised ValueError: lexicon missing" if bad == "raise" else "returned 6 non-finite score"
    with pytest.raises(RewardError, match=f"reward function 'broken' {msg}"):
        P.reward(cfg, 1, ro.path("rollouts"), sa.path("sa_pairs"))
    assert _snapshot(cfg) == before
    assert not (cfg.layout.table(1, "rewards")).exists()


def test_non_finite_loss_fails_training_without_advancing_the_checkpoint(tiny_cfg):
    cfg = tiny_cfg()
    ck, ro, sa = _through_attribute(cfg)
    rw = P.reward(cfg, 1, ro.path("rollouts"), sa.path("sa_pairs"))
    va = P.value(cfg, 1, ro.path("rollouts"), ck)
    ad = P.advantage(cfg, 1, rw.path("rewards"), va.path("values"))
    table = pq.read_table(ad.path("advantages"))
    poisoned = np.array(table.column("whitened_advantage").to_numpy(), copy=True)
    poisoned[0] = np.inf
    table = table.set_column(table.schema.get_field_index("whitened_advantage"), "whitened_advantage", pa.array(poisoned))
    pq.write_table(table, ad.path("advantages"))
    with pytest.raises(TrainingError, match="non-finite policy loss at epoch 0 minibatch 0; .*checkpoint is not advanced"):
        P.train(cfg, 1, ro.path("rollouts"), sa.path("sa_pairs"), ad.path("advantages"), ck)
    assert not cfg.layout.checkpoint(1).dir.exists()
    assert not (cfg.layout.table(1, "metrics")).exists()


def test_disk_full_while_writing_replaces_nothing(tiny_cfg, monkeypatch):
    cfg = tiny_cfg()
    _, ro, sa = _through_attribute(cfg)
    before = _snapshot(cfg)
    real = pq.write_table

    def full_disk(table, where, **kw):
        real(table.slice(0, 1), where, **kw)  # part of the bytes made it out...
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full_disk)
    with pytest.raises(ArtifactWriteError, match="cannot write .*sa_pairs.parquet: No space left on device; nothing was replaced"):
        write_table(cfg.layout.iter_dir(1), "sa_pairs", pq.read_table(sa.path("sa_pairs")))
    assert _snapshot(cfg) == before  # the old file is intact and no temporary file is left
