"""The final policy adapter of a flow run as an MLflow model version, and loading it back to generate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ppo_core import pipeline, registry, track
from ppo_core.config import PPOConfig, load_config
from ppo_core.generate import generate, render_prompts
from ppo_core.layout import mlruns_dir
from ppo_core.models import POLICY
from ppo_core.tables import sha256_file
from ppo_core.tiny import make_tiny_model

PROMPTS = ["How was your day?", "Tell me about the sea.", "What should I cook tonight?"]

# as tests/conftest.py's tiny_cfg, but shared by the whole module: training is the slow part
TINY = dict(batch_size=6, max_new_tokens=8, score_batch_size=4, ppo_epochs=2, num_minibatches=2,
            eval_size=4, eval_max_new_tokens=6, lora_layers=1)


@pytest.fixture(scope="module")
def two_flow_runs(tiny_model_dir, tmp_path_factory):
    """Run 'reg': a first flow run of 2 iterations, then a second of 1."""
    root = tmp_path_factory.mktemp("registry") / "artifacts"
    cfg = PPOConfig(run="reg", model=str(tiny_model_dir), artifact_root=root, **TINY)
    pipeline.run_tracked(cfg, 2)
    first = registry.policy_version(cfg, "latest")
    pipeline.run_tracked(cfg, 1)
    second = registry.policy_version(cfg, "latest")
    return cfg, first, second


def policy_logprobs(model, adapter: str | None) -> tuple[list[list[int]], np.ndarray]:
    gen = generate(model, render_prompts(model, PROMPTS), adapter=adapter, max_new_tokens=6, temperature=0.0)
    return gen.response_ids, np.concatenate([np.array(lp) for lp in gen.sampling_logprobs])


def checkpoint_file(cfg: PPOConfig, iteration: int) -> Path:
    return cfg.layout.checkpoint(iteration).adapter(POLICY)


def test_the_version_points_at_the_logged_adapter_and_is_tagged(two_flow_runs):
    cfg, first, _ = two_flow_runs
    mlf = track.client(cfg)
    run_id = track.ensure_run(cfg)
    assert first.name == "ppo-reg" and int(first.version) == 1
    assert first.run_id == run_id and first.source == f"runs:/{run_id}/adapters/iter=0002"

    tags = first.tags
    manifest = json.loads(cfg.layout.manifest(2).read_text())
    eval_score = [m.value for m in mlf.get_metric_history(run_id, "evaluate/eval_score") if m.step == 2]
    assert tags["ppo.run"] == "reg" and tags["iteration"] == "2"
    assert tags["base_model"] == cfg.model and tags["base_model_dir"] == Path(cfg.model).name
    layout = tuple(tags[k] for k in ("lora_layers", "lora_rank", "lora_alpha", "lora_targets"))
    assert layout == ("1", "8", "16.0", "q_proj,k_proj,v_proj,o_proj")
    assert tags["config_hash"] == cfg.training_hash() == manifest["config_hash"]
    assert tags["code_version"] == manifest["code_version"]
    assert float(tags["eval_score"]) == eval_score[-1]
    assert tags["adapter_sha256"] == sha256_file(checkpoint_file(cfg, 2))
    # the description is a recipe for this very version
    assert "load_registered_policy(cfg, version=1)" in first.description
    assert "models:/ppo-reg/1" in first.description


def test_registering_an_iteration_again_returns_its_version(two_flow_runs):
    cfg, first, _ = two_flow_runs
    again = registry.register_policy(cfg, 2)
    assert int(again.version) == 1 and again.source == first.source
    versions = track.client(cfg).search_model_versions("name = 'ppo-reg'")
    assert sorted(int(v.version) for v in versions) == [1, 2]


def test_a_second_flow_run_adds_a_version_at_its_last_iteration(two_flow_runs):
    cfg, _, second = two_flow_runs
    assert int(second.version) == 2 and second.tags["iteration"] == "3"
    assert second.source.endswith("/adapters/iter=0003")
    latest = registry.policy_version(cfg, "latest")
    assert int(latest.version) == 2 and latest.tags["adapter_sha256"] == sha256_file(checkpoint_file(cfg, 3))


def test_a_loaded_version_generates_exactly_like_its_checkpoint(two_flow_runs):
    cfg, _, _ = two_flow_runs
    cfg = registry.run_config("reg", cfg.artifact_root)  # the pinned config, as a user would get it
    model = registry.load_registered_policy(cfg, 2)
    tokens_v2, logprobs_v2 = policy_logprobs(model, POLICY)

    # version 1 must replace the iteration-3 adapter now in the policy slot
    model = registry.load_registered_policy(cfg, 1)
    tokens_v1, logprobs_v1 = policy_logprobs(model, POLICY)
    base_tokens, base_logprobs = policy_logprobs(model, None)
    model.load_adapter(POLICY, checkpoint_file(cfg, 2))
    tokens_ckpt, logprobs_ckpt = policy_logprobs(model, POLICY)

    assert tokens_v1 == tokens_ckpt
    np.testing.assert_allclose(logprobs_v1, logprobs_ckpt, rtol=0, atol=1e-6)
    # the tiny policy barely moves in 2 iterations, so its greedy tokens may equal the base's: compare logprobs
    if tokens_v1 == base_tokens:
        assert np.abs(logprobs_v1 - base_logprobs).max() > 1e-3
    if tokens_v1 == tokens_v2:
        assert np.abs(logprobs_v1 - logprobs_v2).max() > 1e-4


def test_a_different_lora_layout_or_base_model_is_refused_before_the_model_loads(two_flow_runs, tmp_path, monkeypatch):
    cfg, _, _ = two_flow_runs

    def no_model(_cfg):
        raise AssertionError("the base model was loaded before the check")

    monkeypatch.setattr(registry, "load_policy_value_model", no_model)
    other_rank = registry.run_config("reg", cfg.artifact_root, {"lora_rank": 4})
    with pytest.raises(registry.RegistryError, match=r"version 1 does not fit this config: lora_rank '8' \(config: '4'\)"):
        registry.load_registered_policy(other_rank, 1)

    other_model = make_tiny_model(tmp_path / "other-tiny", seed=1)
    other_base = registry.run_config("reg", cfg.artifact_root, {"model": str(other_model), "lora_targets": ["q_proj"]})
    mismatch = (r"base_model_dir 'tiny' \(config: 'other-tiny'\), "
                r".*lora_targets 'q_proj,k_proj,v_proj,o_proj' \(config: 'q_proj'\)")
    with pytest.raises(registry.RegistryError, match=mismatch) as err:
        registry.load_registered_policy(other_base, "latest")
    assert "run 'reg'" in str(err.value)


def test_a_missing_version_or_model_is_named(two_flow_runs):
    cfg, _, _ = two_flow_runs
    with pytest.raises(registry.RegistryError, match=r"'ppo-reg' has no version 7 \(it has \[1, 2\]\)"):
        registry.policy_version(cfg, 7)
    with pytest.raises(registry.RegistryError, match="must be a number or 'latest'"):
        registry.policy_version(cfg, "newest")
    with pytest.raises(registry.RegistryError, match="'ppo-nobody' has no versions"):
        registry.policy_version(registry.run_config("nobody", cfg.artifact_root), "latest")


def test_an_untracked_iteration_is_logged_when_registered_and_an_altered_artifact_is_refused(tiny_cfg):
    cfg = tiny_cfg(run="untracked")
    pipeline.start(cfg)  # iteration 0 without MLflow: nothing logged yet
    mv = registry.register_policy(cfg, 0)
    assert mv.source.endswith("/adapters/iter=0000") and "eval_score" not in mv.tags

    logged = next(mlruns_dir(cfg.artifact_root).rglob(f"{track.adapter_artifact_dir(0)}/{registry.POLICY_FILE}"))
    assert sha256_file(logged) == sha256_file(checkpoint_file(cfg, 0))
    logged.write_bytes(checkpoint_file(cfg, 0).read_bytes()[:-1] + b" ")
    with pytest.raises(registry.RegistryError, match="is not the file registered"):
        registry.load_registered_policy(cfg, 1)


def test_registration_checks_the_upload_against_the_manifest_and_loading_needs_the_hash_tag(tiny_cfg):
    cfg = tiny_cfg(run="tampered")
    pipeline.start(cfg)
    mv = registry.register_policy(cfg, 0)
    mlf = track.client(cfg)
    mlf.delete_model_version_tag(mv.name, mv.version, "adapter_sha256")
    with pytest.raises(registry.RegistryError, match="has no adapter_sha256 tag: it cannot be checked"):
        registry.load_registered_policy(cfg, int(mv.version))
    # an uploaded copy that is not the checkpoint the manifest recorded is never registered
    logged = next(mlruns_dir(cfg.artifact_root).rglob(f"{track.adapter_artifact_dir(0)}/{registry.POLICY_FILE}"))
    logged.write_bytes(logged.read_bytes()[:-1] + b" ")
    mlf.delete_model_version(mv.name, mv.version)
    with pytest.raises(registry.RegistryError, match="is not the checkpoint its manifest recorded"):
        registry.register_policy(cfg, 0)


def test_the_version_description_shows_no_credentials(two_flow_runs, monkeypatch):
    assert track.shareable_uri("postgresql://ppo:s3cret@db.example:5432/mlflow?sslmode=require&password=x") == \
        "postgresql://db.example:5432/mlflow"
    assert track.shareable_uri("sqlite:////work/a/mlflow.db") == "sqlite:////work/a/mlflow.db"
    cfg, first, _ = two_flow_runs
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://admin:hunter2@mlflow.example:5000")
    text = registry._how_to_load(cfg, first.name, first.version, first.tags)
    assert "hunter2" not in text and "admin" not in text and "MLFLOW_TRACKING_URI=http://mlflow.example:5000" in text


@pytest.mark.usefixtures("prefect_server")
def test_the_prefect_flow_registers_its_final_policy(tiny_cfg):
    from flows.ppo import ppo

    keep = ("model", "artifact_root", *TINY)
    config = tiny_cfg().to_json_dict()
    overrides = {k: str(config[k]) if k in ("model", "artifact_root") else config[k] for k in keep}
    ppo(run="flowreg", iterations=1, overrides=overrides)
    cfg = load_config(overrides={**overrides, "run": "flowreg"})
    mv = registry.policy_version(cfg, "latest")
    assert int(mv.version) == 1 and mv.tags["iteration"] == "1"
    assert registry.generate_text(registry.load_registered_policy(cfg), ["Hello!"], max_new_tokens=4)


def test_ppo_generate_answers_with_a_registered_version_and_names_a_missing_one(two_flow_runs):
    from typer.testing import CliRunner

    from flows.cli import app

    cfg, _, _ = two_flow_runs
    args = ["generate", PROMPTS[0], PROMPTS[1], "--run", "reg", "--root", str(cfg.artifact_root), "--max-new-tokens", "5"]
    result = CliRunner().invoke(app, [*args, "--version", "1"])
    assert result.exit_code == 0, result.output
    expected = registry.generate_text(registry.load_registered_policy(registry.run_config("reg", cfg.artifact_root), 1),
                                      PROMPTS[:2], max_new_tokens=5)
    assert result.stdout == "".join(f"> {p}\n{a}\n\n" for p, a in zip(PROMPTS[:2], expected))
    assert result.stderr == "# ppo-reg version 1 (iteration 2 of run 'reg')\n"  # what was loaded, outside the answers

    missing = CliRunner().invoke(app, [*args, "--version", "9"])
    assert missing.exit_code == 2 and "'ppo-reg' has no version 9 (it has [1, 2])" in missing.output
