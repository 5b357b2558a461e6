"""dtype by device: float32 on the CPU, bfloat16 on a GPU, a config field to override.

The GPU itself cannot run on this machine; the selection is tested with the
device type passed in, and a bfloat16 base model is run end to end on the CPU
(slowly, on the tiny model) to check that adapters, heads, logprobs, losses
and optimiser state stay float32 around it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import polars as pl
import pytest

from ppo_core import pipeline
from ppo_core.config import PPOConfig
from ppo_core.models import POLICY, VALUE, ModelCache, compute_dtype
from ppo_core.tables import read_table


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [("auto", mx.cpu, mx.float32), ("auto", mx.gpu, mx.bfloat16), ("float32", mx.gpu, mx.float32),
     ("bfloat16", mx.cpu, mx.bfloat16), ("float16", mx.gpu, mx.float16)],
)
def test_dtype_selection(setting, device, expected):
    assert compute_dtype(setting, device) == expected


def test_auto_is_this_machines_default_and_float32_here():
    assert compute_dtype("auto") == (mx.float32 if mx.default_device().type == mx.cpu else mx.bfloat16)


def test_dtype_is_part_of_a_runs_identity_but_auto_keeps_old_runs():
    """Runs made before the field existed hash as 'auto' runs; an explicit dtype is a different run."""
    before = PPOConfig().to_json_dict()
    before.pop("dtype")
    import hashlib
    import json

    for k in ("run", "artifact_root", "generation_batch_size"):
        before.pop(k)
    for k in ("samples_per_prompt", "advantage_estimator", "lr_schedule", "lr_warmup_steps", "lr_decay_iterations",
              "lr_min_ratio", "value_warmup_iterations"):
        before.pop(k)
    assert PPOConfig().training_hash() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert PPOConfig(dtype="bfloat16").training_hash() != PPOConfig().training_hash()


def test_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="dtype"):
        PPOConfig(dtype="int8")


def test_bfloat16_base_runs_an_iteration_with_float32_around_it(tiny_cfg):
    cfg = tiny_cfg(dtype="bfloat16", temperature=0.8)
    pipeline.run(cfg, 1)
    model = ModelCache().get(cfg)
    assert model.backbone.layers[0].mlp.gate_proj.weight.dtype == mx.bfloat16
    assert all(v.dtype == mx.float32 for a in (POLICY, VALUE) for v in model.trainable(a).values())
    sa = pl.from_arrow(read_table(cfg.layout.table(1, "sa_pairs")))
    for col in ("logprob", "ref_logprob", "kl", "entropy"):
        assert sa[col].dtype == pl.Float32 and np.isfinite(sa[col].to_numpy()).all()
    metrics = pl.from_arrow(read_table(cfg.layout.table(1, "metrics")))
    assert np.isfinite(metrics["policy_loss"].to_numpy()).all() and np.isfinite(metrics["value_loss"].to_numpy()).all()
    # attribute and train score the same tokens the same way: the first step's ratio is 1
    assert abs(metrics.row(0, named=True)["approx_kl"]) < 1e-3
    ckpt = cfg.layout.checkpoint(1)
    for a in (POLICY, VALUE):
        assert all(v.dtype == mx.float32 for v in mx.load(str(ckpt.adapter(a))).values())
        assert all(v.dtype in (mx.float32, mx.uint64, mx.int32) for v in mx.load(str(ckpt.optimizer(a))).values())
