"""One flipped bit in a run's artifacts: found by its hash and recomputed to the same bytes, or refused by name.

Already covered elsewhere, not repeated here: a truncated/flipped table and a
phase record with bad UTF-8 or a wrong hash digit inside an iteration
(tests/test_phases.py), the policy adapter of a finished checkpoint with its
last bytes zeroed (tests/test_security.py), a registered adapter whose last
byte changed, loaded with ``load_registered_policy`` (tests/test_registry.py).
Here: the header and the weights of every checkpoint file (adapters and
optimiser state) of a finished iteration that the next one trains on, a
damaged checkpoint two iterations back, the checkpoint of an iteration killed
before its manifest, a bit flipped anywhere in a phase record, and a flipped
bit in a registered adapter met by ``download_policy``, ``ppo export`` and
``ppo generate``.
"""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppo_core import pipeline, runs
from ppo_core.config import PPOConfig
from ppo_core.layout import Checkpoint
from ppo_core.phase_records import record_digest

TINY = dict(batch_size=6, max_new_tokens=8, score_batch_size=4, ppo_epochs=2, num_minibatches=2, eval_size=4,
            eval_max_new_tokens=6, lora_layers=1)


def config(model_dir: Path, root: Path) -> PPOConfig:
    return PPOConfig(run="d", model=str(model_dir), artifact_root=root, **TINY)


def artifact_bytes(cfg: PPOConfig, iteration: int) -> dict[str, bytes]:
    """Every table and checkpoint file of ``iteration`` (records and the manifest hold times and pids)."""
    it_dir = cfg.layout.iter_dir(iteration)
    files = sorted(p for p in it_dir.rglob("*") if p.suffix in (".parquet", ".safetensors") and not p.name.startswith("."))
    return {str(p.relative_to(it_dir)): p.read_bytes() for p in files}


def flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def safetensors_offset(path: Path, where: str) -> int:
    """A byte in the middle of the file's JSON header (the file stops loading) or of its tensors (it still loads)."""
    data = path.read_bytes()
    header = struct.unpack("<Q", data[:8])[0]
    if where == "header":
        return 8 + header // 2
    return 8 + header + (len(data) - 8 - header) // 2


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> dict[int, dict[str, bytes]]:
    """The bytes of an uninterrupted 3-iteration run: what every repaired run must end on."""
    cfg = config(tiny_model_dir, tmp_path_factory.mktemp("reference") / "artifacts")
    pipeline.run(cfg, 3)
    return {it: artifact_bytes(cfg, it) for it in (1, 2, 3)}


def file_of(ckpt: Checkpoint, name: str) -> Path:
    adapter, kind = name.split("_")
    return ckpt.adapter(adapter) if kind == "adapter" else ckpt.optimizer(adapter)


@pytest.mark.parametrize(
    "name, where",
    [("policy_adapter", "header"), ("value_adapter", "tensors"), ("policy_optimizer", "header"),
     ("policy_optimizer", "tensors"), ("value_optimizer", "tensors")],
)
def test_a_flipped_bit_in_a_finished_checkpoint_is_recomputed_before_the_next_iteration_trains_on_it(
    tiny_model_dir, tmp_path, reference, name, where
):
    cfg = config(tiny_model_dir, tmp_path / "artifacts")
    pipeline.run(cfg, 2)
    path = file_of(cfg.layout.checkpoint(2), name)
    good = path.read_bytes()
    flip(path, safetensors_offset(path, where))
    assert runs.damaged_artifacts(cfg, 2) == [f"iter=0002/checkpoint/{path.name}"]

    done = pipeline.run(cfg, 1)
    assert list(done) == [3]
    assert path.read_bytes() == good and runs.damaged_artifacts(cfg, 2) == []
    # nothing trained from the damaged file: iteration 3 holds the uninterrupted run's bytes, iteration 2 kept them
    assert artifact_bytes(cfg, 3) == reference[3]
    assert artifact_bytes(cfg, 2) == reference[2]
    assert cfg.layout.completed_iterations() == [0, 1, 2, 3]


def test_damaged_checkpoints_two_iterations_back_are_recomputed_in_order(tiny_model_dir, tmp_path, reference):
    """Redoing iteration 2 trains from checkpoint 1: its damaged optimiser state is recomputed first."""
    cfg = config(tiny_model_dir, tmp_path / "artifacts")
    pipeline.run(cfg, 2)
    opt1 = cfg.layout.checkpoint(1).optimizer("value")
    adapter2 = cfg.layout.checkpoint(2).adapter("policy")
    good1, good2 = opt1.read_bytes(), adapter2.read_bytes()
    flip(opt1, safetensors_offset(opt1, "tensors"), bit=7)
    flip(adapter2, safetensors_offset(adapter2, "tensors"), bit=3)

    pipeline.run(cfg, 1)
    assert opt1.read_bytes() == good1 and adapter2.read_bytes() == good2
    assert {it: artifact_bytes(cfg, it) for it in (1, 2, 3)} == reference


def test_a_flipped_bit_in_the_checkpoint_of_an_iteration_killed_before_its_manifest_is_recomputed(
    tiny_model_dir, tmp_path, reference
):
    cfg = config(tiny_model_dir, tmp_path / "artifacts")
    pipeline.run(cfg, 3)
    cfg.layout.manifest(3).unlink()  # killed after its last phase: iteration 3 is not finished
    opt = cfg.layout.checkpoint(3).optimizer("policy")
    flip(opt, safetensors_offset(opt, "tensors"))

    done = pipeline.run(cfg, 1)
    assert list(done) == [3]  # the unfinished iteration, not a fourth
    train = next(r for r in done[3] if r["phase"] == "train")
    assert not train["cached"]  # its record's hash of the optimiser state no longer matched
    assert artifact_bytes(cfg, 3) == reference[3]


# ---------------------------------------------------------------- phase records


@pytest.fixture(scope="module")
def recorded(tiny_model_dir, tmp_path_factory):
    """Iteration 1 of a run, and its phase results by phase."""
    cfg = config(tiny_model_dir, tmp_path_factory.mktemp("records") / "artifacts")
    pipeline.start(cfg)
    return cfg, {r["phase"]: r for r in pipeline.run_iteration(cfg, 1)}


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(phase=st.sampled_from(["rollout", "reward", "advantage", "train"]), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))
def test_a_bit_flipped_anywhere_in_a_phase_record_recomputes_the_same_bytes_or_changes_nothing(recorded, phase, where, bit):
    cfg, first = recorded
    path = cfg.layout.phase_record(1, phase)
    good = path.read_bytes()
    offset = int(where * len(good))
    damaged = bytearray(good)
    damaged[offset] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    try:
        again = {r["phase"]: r for r in pipeline.run_iteration(cfg, 1)}
        for name, result in first.items():
            assert (result["outputs"], result["hashes"], result["stats"]) == \
                   (again[name]["outputs"], again[name]["hashes"], again[name]["stats"]), name
        record = json.loads(path.read_text())
        assert record["hashes"] == first[phase]["hashes"] and record["stats"] == first[phase]["stats"]
        # a damaged record is never reused: whatever is there now is whole (its own digest fits)
        assert record["record_sha256"] == record_digest(record)
    finally:
        path.write_bytes(good)  # the next example starts from the shared run as it was


def test_a_flipped_digit_in_a_phase_records_stats_is_not_reused(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path / "artifacts")
    pipeline.run(cfg, 1)
    manifest = json.loads(cfg.layout.manifest(1).read_text())
    cfg.layout.manifest(1).unlink()  # killed before the manifest: the records are all there is
    record = cfg.layout.phase_record(1, "reward")
    text = record.read_text()
    assert '"kl_coef": 0.05' in text
    record.write_text(text.replace('"kl_coef": 0.05', '"kl_coef": 0.15'))  # one bit: '0' (0x30) -> '1' (0x31)
    pipeline.run(cfg, 1)
    assert json.loads(cfg.layout.manifest(1).read_text())["phases"]["reward"]["stats"] == manifest["phases"]["reward"]["stats"]


# ---------------------------------------------------------------- tables of finished iterations


def test_a_flipped_bit_in_a_table_of_a_finished_iteration_is_found_when_the_run_resumes(tiny_model_dir, tmp_path, reference):
    cfg = config(tiny_model_dir, tmp_path / "artifacts")
    pipeline.run(cfg, 2)
    table = cfg.layout.table(1, "sa_pairs")
    flip(table, len(table.read_bytes()) // 2)
    pipeline.run(cfg, 1)
    assert artifact_bytes(cfg, 1) == reference[1]


# ---------------------------------------------------------------- registered models


def test_a_flipped_bit_in_a_registered_adapter_is_refused_by_download_export_and_generate(tiny_model_dir, tmp_path):
    from flows.cli import app
    from ppo_core import registry, track
    from ppo_core.layout import mlruns_dir

    cfg = config(tiny_model_dir, tmp_path / "artifacts")
    pipeline.start(cfg)
    mv = registry.register_policy(cfg, 0)
    logged = next(mlruns_dir(cfg.artifact_root).rglob(f"{track.adapter_artifact_dir(0)}/{registry.POLICY_FILE}"))
    flip(logged, safetensors_offset(logged, "tensors"), bit=2)  # still a loadable file, with other weights

    with pytest.raises(registry.RegistryError, match=r"version 1 .* is not the file registered .*altered or replaced"):
        registry.download_policy(cfg, mv.version, tmp_path / "download")
    root = ["--run", cfg.run, "--root", str(cfg.artifact_root)]
    out = tmp_path / "exported"
    for args in (["export", str(out), *root], ["export", str(out), *root, "--fuse"], ["generate", "Hi", *root]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "is not the file registered" in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert not out.exists() and not list(tmp_path.glob(".exported.*"))  # no half-written export folder
