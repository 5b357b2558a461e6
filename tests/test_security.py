"""What the servers expose: the host/origin guard, the refusal of a bare non-loopback host, MLflow's flags."""

from __future__ import annotations

import asyncio
import threading

import pytest

from flows.prefect_app import HostOriginGuard
from flows.serve import allowed_hosts, is_loopback, mlflow_ui_command, serve, server_env
from ppo_core.config import load_config


async def _ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(guard: HostOriginGuard, headers: dict[str, str]) -> int:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    scope = {"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    # in a thread of its own: earlier tests in this process may leave an event loop running in the main one
    worker = threading.Thread(target=asyncio.run, args=(guard(scope, receive, send),))
    worker.start()
    worker.join()
    return sent[0]["status"]


def test_the_guard_passes_its_own_host_and_origin_only():
    guard = HostOriginGuard(_ok_app, {"127.0.0.1:4200", "localhost:4200"}, {"http://127.0.0.1:4200"})
    assert _call(guard, {"host": "127.0.0.1:4200"}) == 200
    assert _call(guard, {"host": "LOCALHOST:4200", "origin": "http://127.0.0.1:4200"}) == 200
    assert _call(guard, {"host": "rebound.example:4200"}) == 403
    assert _call(guard, {"host": "127.0.0.1:4200", "origin": "https://evil.example"}) == 403
    assert _call(guard, {}) == 403  # no Host at all


def test_loopback_hosts_and_the_lists_the_server_gets():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("box.example")
    assert allowed_hosts("127.0.0.1", 4200) == ["127.0.0.1:4200", "localhost:4200"]
    env = server_env("127.0.0.1", 4200, {})
    assert env["PREFECT_SERVER_CSRF_PROTECTION_ENABLED"] == "true"
    assert env["PREFECT_SERVER_CORS_ALLOWED_ORIGINS"] == "http://127.0.0.1:4200,http://localhost:4200"
    assert "0.0.0.0:4200" not in allowed_hosts("0.0.0.0", 4200)


def test_a_non_loopback_host_without_an_auth_string_is_refused(monkeypatch):
    monkeypatch.delenv("PREFECT_SERVER_API_AUTH_STRING", raising=False)
    said = []
    assert serve(host="0.0.0.0", port=1, log=said.append) == 2  # before any process starts
    assert "refusing to serve the Prefect API on 0.0.0.0" in said[0] and "PREFECT_SERVER_API_AUTH_STRING" in said[0]


def test_mlflow_ui_gets_explicit_guards_and_no_inherited_loosening(tmp_path):
    cfg = load_config(None, {"artifact_root": tmp_path})
    loosened = {"MLFLOW_SERVER_DISABLE_SECURITY_MIDDLEWARE": "true", "MLFLOW_SERVER_ALLOWED_HOSTS": "*",
                "MLFLOW_SERVER_CORS_ALLOWED_ORIGINS": "*", "PATH": "/usr/bin"}
    command, env = mlflow_ui_command(cfg, "127.0.0.1", 5000, loosened)
    assert {k: v for k, v in env.items() if k not in ("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "PYTHONWARNINGS")} == {"PATH": "/usr/bin"}
    flags = dict(zip(command[::1], command[1::1]))
    assert flags["--allowed-hosts"] == "127.0.0.1:5000,localhost:5000"
    assert flags["--cors-allowed-origins"] == "http://127.0.0.1:5000,http://localhost:5000"
    assert flags["--x-frame-options"] == "SAMEORIGIN"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_needs_no_auth_string(host):
    from flows.serve import check_host

    check_host(host, {})


def test_deployment_paths_must_lie_under_the_allowed_roots(tmp_path, monkeypatch):
    from ppo_core.allowed_paths import DEFAULT_ROOTS, ROOTS_ENV, check_allowed_paths
    from ppo_core.config import PROJECT_ROOT, ConfigError

    monkeypatch.delenv(ROOTS_ENV, raising=False)
    check_allowed_paths(load_config(None, {}))  # the defaults are the project's own folders
    assert DEFAULT_ROOTS[0] == PROJECT_ROOT / "artifacts"
    with pytest.raises(ConfigError, match=r"'eval_prompts_path' = /etc/passwd"):
        check_allowed_paths(load_config(None, {"eval_prompts_path": "/etc/passwd"}))
    # a symlink inside a root that points outside it is outside
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sneaky.jsonl").symlink_to("/etc/hostname")
    monkeypatch.setenv(ROOTS_ENV, str(tmp_path / "data"))
    cfg = load_config(None, {"prompts_path": tmp_path / "data" / "sneaky.jsonl", "artifact_root": tmp_path / "data" / "art"})
    with pytest.raises(ConfigError, match=r"'prompts_path' = .*sneaky.jsonl.*'eval_prompts_path'.*PPO_ALLOWED_ROOTS"):
        check_allowed_paths(cfg)
    evil = tmp_path / "evil.py"
    evil.write_text("def f(p, r):\n    return [0.0] * len(r)\n")
    for overrides, name in [({"reward": f"python:{evil}:f"}, "reward"), ({"model": str(tmp_path)}, "model"),
                            ({"reward": f"model:{tmp_path / 'rm.safetensors'}"}, "reward"),
                            ({"artifact_root": str(tmp_path / "elsewhere")}, "artifact_root")]:
        monkeypatch.delenv(ROOTS_ENV, raising=False)
        with pytest.raises(ConfigError, match=f"'{name}' = "):
            check_allowed_paths(load_config(None, overrides))
    with pytest.raises(ConfigError, match=r"'config' = /etc/ppo.toml"):
        check_allowed_paths(load_config(None, {}), "/etc/ppo.toml")


# ---------------------------------------------------------------- artifacts checked before use


def test_a_damaged_checkpoint_is_recomputed_before_the_next_iteration_trains_on(tiny_cfg):
    from ppo_core import pipeline, runs

    cfg = tiny_cfg()
    pipeline.run(cfg, 2)
    adapter = cfg.layout.checkpoint(2).adapter("policy")
    good = adapter.read_bytes()
    adapter.write_bytes(good[:-8] + b"\x00" * 8)  # bit rot in the weights' last bytes: still a readable file
    assert runs.damaged_artifacts(cfg, 2) == ["iter=0002/checkpoint/policy_adapter.safetensors"]
    pipeline.run(cfg, 1)
    assert adapter.read_bytes() == good and runs.damaged_artifacts(cfg, 2) == []
    assert cfg.layout.completed_iterations() == [0, 1, 2, 3]


def test_a_damaged_file_that_recomputes_to_other_bytes_stops_the_run_and_keeps_the_manifest(tiny_cfg, monkeypatch):
    import dataclasses

    import pyarrow.compute as pc

    from ppo_core import phases, pipeline, runs

    cfg = tiny_cfg()
    pipeline.run(cfg, 1)
    table = cfg.layout.table(1, "sa_pairs")
    table.write_bytes(table.read_bytes()[:-20] + b"\x00" * 20)
    manifest = cfg.layout.manifest(1).read_bytes()
    # as if the code had changed since iteration 1 was trained: the phase no longer writes what it wrote then
    spec = phases.DATA_PHASES["attribute"]

    def changed(cfg, t):
        out, stats = spec.finish(cfg, t)
        return out.set_column(out.schema.get_field_index("entropy"), "entropy", pc.add(out["entropy"], 1.0)), stats

    monkeypatch.setitem(phases.DATA_PHASES, "attribute", dataclasses.replace(spec, finish=changed))
    with pytest.raises(runs.ArtifactIntegrityError, match=r"iter=0001/sa_pairs.parquet .* even after recomputing"):
        pipeline.run(cfg, 1)
    assert cfg.layout.manifest(1).read_bytes() == manifest  # what later iterations were trained on stays the record
    assert cfg.layout.completed_iterations() == [0, 1]


def test_a_changed_reward_model_or_reward_code_is_refused_mid_run(tiny_cfg, vowel_reward):
    from ppo_core import pipeline
    from ppo_core.config import ConfigError

    cfg = tiny_cfg(reward=vowel_reward, eval_size=0)
    pipeline.run(cfg, 1)
    code = cfg.reward_source_file
    code.write_text(code.read_text() + "\n# retuned\n")
    with pytest.raises(ConfigError, match=r"other contents of: reward code .*must not change mid-run"):
        pipeline.run(cfg, 1)


def test_adapter_and_optimiser_files_are_checked_before_they_load(tiny_cfg, tmp_path):
    import mlx.core as mx

    from ppo_core import phases as P
    from ppo_core.models import ModelError
    from ppo_core.train import TrainingError, load_optimizer, make_optimizer

    cfg = tiny_cfg()
    P.init_checkpoint(cfg)
    model = P.model_for(cfg, cfg.layout.checkpoint(0))
    flat = mx.load(str(cfg.layout.checkpoint(0).adapter("policy")))
    key = sorted(flat)[0]
    mx.save_safetensors(str(tmp_path / "wrong.safetensors"), {**flat, key: mx.zeros((3, 3))})
    with pytest.raises(ModelError, match=r"wrong shape or dtype: .*\(3, 3\)"):
        model.load_adapter("policy", tmp_path / "wrong.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelError, match="cannot read adapter file"):
        model.load_adapter("policy", tmp_path / "junk.safetensors")
    with pytest.raises(TrainingError, match="cannot read optimiser state"):
        load_optimizer(make_optimizer(1e-3), tmp_path / "junk.safetensors")


# ---------------------------------------------------------------- smaller ones


def test_names_are_checked_before_any_path_is_built(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app
    from ppo_core import registry
    from ppo_core.layout import RunLayout, reward_model_path

    for bad in ("../etc", "a/b", ".."):
        with pytest.raises(ValueError, match="run name"):
            RunLayout(tmp_path, bad)
        with pytest.raises(ValueError, match="reward model name"):
            reward_model_path(tmp_path, bad)
        with pytest.raises(ValueError, match="run name"):
            registry.run_config(bad, tmp_path)
    result = CliRunner().invoke(app, ["report", "--run", "../../etc", "--root", str(tmp_path)])
    assert result.exit_code == 2 and "run name '../../etc'" in result.output


def test_a_stray_iteration_folder_does_not_break_the_views(tiny_cfg):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppo_core import pipeline
    from ppo_core.query import connect

    cfg = tiny_cfg(eval_size=2)
    pipeline.run(cfg, 1)
    stray = cfg.layout.run_dir / "iter=foo"
    stray.mkdir()
    pq.write_table(pa.table({"x": [1]}), stray / "eval.parquet")
    assert cfg.layout.iterations() == [0, 1]
    assert connect(cfg.artifact_root).sql("SELECT DISTINCT iter FROM eval ORDER BY iter").fetchall() == [(0,), (1,)]


def test_the_flows_never_pickle_their_results():
    from flows.ppo import ppo
    from flows.reward_model import reward_model

    assert ppo.persist_result is False and reward_model.persist_result is False


# ---------------------------------------------------------------- bounded work


def test_a_config_too_large_for_the_machine_is_refused_before_a_model_loads(tmp_path):
    from ppo_core.config import ConfigError
    from ppo_core.memory import GB, check_memory
    from ppo_core.prompts import load_prompts

    defaults = load_config(None, {})
    prompts = [load_prompts(defaults.prompts_path), load_prompts(defaults.eval_prompts_path)]
    assert check_memory(defaults, prompts, available=24 * GB).total < 4 * GB  # the defaults fit easily
    big = load_config(None, {"batch_size": 4096, "max_new_tokens": 2048, "artifact_root": tmp_path})
    with pytest.raises(ConfigError, match=r"needs about \d+ GB .*longest prompt about \d+ tokens\), more than this machine's 24 GB: shorten .* batch_size"):
        check_memory(big, prompts, available=24 * GB)
    from ppo_core.runs import check_inputs

    with pytest.raises(ConfigError, match="more than this machine's"):  # what every run does first
        check_inputs(load_config(None, {"batch_size": 256, "samples_per_prompt": 16, "max_new_tokens": 2048,
                                        "artifact_root": tmp_path}))


def test_generation_in_chunks_samples_what_one_batch_would(tiny_cfg):
    import numpy as np

    from ppo_core import phases as P
    from ppo_core.generate import generate, generate_chunked, render_prompts

    cfg = tiny_cfg()
    P.init_checkpoint(cfg)
    model = P.model_for(cfg, cfg.layout.checkpoint(0))
    prompts = render_prompts(model, ["a b c", "Tell me about the sea.", "Hi", "What should I cook tonight?", "x"])
    kw = dict(adapter="policy", max_new_tokens=6, temperature=1.0, seeds=[5, 6, 7, 8, 9])
    whole, chunked = generate(model, prompts, **kw), generate_chunked(model, prompts, chunk=2, **kw)
    assert chunked.response_ids == whole.response_ids and chunked.finish_reasons == whole.finish_reasons
    for a, b in zip(chunked.sampling_logprobs, whole.sampling_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_iterations_and_input_files_are_bounded(tmp_path, monkeypatch):
    from flows.ppo import MAX_ITERATIONS, ppo
    from ppo_core import prompts
    from ppo_core.prompts import PromptsError, load_prompts

    with pytest.raises(ValueError, match=f"'iterations' must be between 1 and {MAX_ITERATIONS}"):
        ppo.fn(run="x", iterations=MAX_ITERATIONS + 1)
    big = tmp_path / "p.jsonl"
    big.write_text('{"prompt": "hello"}\n' * 100)
    monkeypatch.setattr(prompts, "MAX_PROMPTS_BYTES", 1000)
    with pytest.raises(PromptsError, match="more than the 0 MB a prompts file may hold"):
        load_prompts(big)


def test_an_eval_prompt_longer_than_the_context_is_named(tiny_cfg, tmp_path):
    from ppo_core import phases as P
    from ppo_core.prompts import PromptsError

    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt_id": "ok", "prompt": "Hi"}\n{"prompt_id": "huge", "prompt": "' + "word " * 600 + '"}\n')
    cfg = tiny_cfg(eval_prompts_path=path, eval_size=2)
    P.init_checkpoint(cfg)
    with pytest.raises(PromptsError, match=r"prompt 'huge' is \d+ tokens; with max_new_tokens=6 it exceeds the model context of 512"):
        P.evaluate(cfg, 0, cfg.layout.checkpoint(0))


def test_a_damaged_run_json_or_manifest_is_named(tiny_cfg):
    from ppo_core import pipeline, runs

    cfg = tiny_cfg(eval_size=0)
    pipeline.run(cfg, 1)
    cfg.layout.manifest(1).write_text('{"artifacts": {')
    with pytest.raises(runs.ArtifactIntegrityError, match=r"manifest of iteration 1 .*manifest.json is damaged"):
        pipeline.run(cfg, 1)
    cfg.layout.run_json.write_bytes(b"\xff\xfe not json")
    with pytest.raises(runs.ArtifactIntegrityError, match=r"pinned config .*run.json is damaged"):
        pipeline.run(cfg, 1)


def test_the_run_lock_names_its_host(tiny_cfg):
    import socket

    from ppo_core.runs import RunBusyError, run_lock

    cfg = tiny_cfg()
    with run_lock(cfg):
        with pytest.raises(RunBusyError, match=f"being trained by pid \\d+ on host {socket.gethostname()}"):
            with run_lock(cfg):
                pass


@pytest.mark.slow
def test_a_concurrent_first_conversion_keeps_the_finished_copy(tmp_path):
    """The loser of two first runs converting SmolLM2 at once discards its copy; it never deletes the winner's."""
    from ppo_core.convert import convert_gguf
    from ppo_core.models import smollm2_gguf

    out = tmp_path / "models" / "smollm2"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"the other process's finished weights")
    assert convert_gguf(smollm2_gguf(), out) == out
    assert (out / "model.safetensors").read_bytes() == b"the other process's finished weights"
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"]  # no temporary folder left behind


def test_deployment_checks_come_before_reading_and_hand_on_resolved_paths(tmp_path, monkeypatch):
    from ppo_core.allowed_paths import ROOTS_ENV, check_allowed_paths, check_config_file
    from ppo_core.config import ConfigError

    monkeypatch.delenv(ROOTS_ENV, raising=False)
    with pytest.raises(ConfigError, match="'config' = /root/secret.toml"):
        check_config_file("/root/secret.toml")  # refused without opening (or even stat-ing) it
    with pytest.raises(ConfigError, match="python: rewards as files .* not modules"):
        check_allowed_paths(load_config(None, {"reward": "python:this.x:f"}))
    monkeypatch.setenv(ROOTS_ENV, str(tmp_path))
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real" / "p.jsonl")
    cfg = load_config(None, {"prompts_path": tmp_path / "link.jsonl", "eval_prompts_path": tmp_path / "real" / "p.jsonl",
                             "artifact_root": tmp_path / "art"})
    checked = check_allowed_paths(cfg)
    assert checked.prompts_path == tmp_path / "real" / "p.jsonl"  # what was checked is what the run reads


def test_ipv6_and_port_80_host_headers():
    assert allowed_hosts("::1", 4200) == ["127.0.0.1:4200", "[::1]:4200", "localhost:4200"]
    assert "localhost" in allowed_hosts("127.0.0.1", 80) and "localhost:80" in allowed_hosts("127.0.0.1", 80)


def test_runs_pinned_before_new_fields_existed_still_resume(tiny_cfg):
    import json

    from ppo_core import pipeline, runs

    cfg = tiny_cfg(eval_size=0)
    pipeline.run(cfg, 1)
    pinned = json.loads(cfg.layout.run_json.read_text())
    for k in ("samples_per_prompt", "advantage_estimator", "lr_schedule", "generation_batch_size"):
        pinned["config"].pop(k)  # as a run started before these fields existed wrote it
    cfg.layout.run_json.write_text(json.dumps(pinned))
    runs.pin_config(cfg)  # accepted: the missing fields hold their defaults
    assert pipeline.run_iteration(cfg, 1)[0]["cached"]  # and the caches still match
    assert cfg.model_copy(update={"generation_batch_size": 8}).training_hash() == cfg.training_hash()


def test_a_backup_of_an_iteration_folder_stays_out_of_the_views(tiny_cfg):
    import shutil

    from ppo_core import pipeline
    from ppo_core.query import connect

    cfg = tiny_cfg(eval_size=2)
    pipeline.run(cfg, 1)
    shutil.copytree(cfg.layout.iter_dir(1), cfg.layout.run_dir / "iter=0001.bak")
    assert connect(cfg.artifact_root).sql("SELECT DISTINCT iter FROM eval ORDER BY iter").fetchall() == [(0,), (1,)]


def test_credentials_in_a_query_are_dropped_even_without_a_host():
    from ppo_core.track import shareable_uri

    assert shareable_uri("postgresql:///mlflow?user=u&password=s3cret") == "postgresql:///mlflow"


def test_a_retrained_reward_model_is_refused_mid_run(tiny_cfg, tmp_path):
    from ppo_core import pipeline
    from ppo_core.config import ConfigError
    from ppo_core.reward_model import train_from_file
    from ppo_core.config import RewardModelSettings

    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text("".join(
        '{"prompt": "p%d", "chosen": "good %d", "rejected": "bad %d"}\n' % (i, i, i) for i in range(8)
    ))
    base = tiny_cfg()
    settings = RewardModelSettings(data=pairs, name="rm", epochs=1, batch_size=4, eval_fraction=0.25)
    path = train_from_file(base, settings)["path"]
    cfg = tiny_cfg(run="rm-pinned", reward=f"model:{path}", eval_size=0)
    pipeline.run(cfg, 1)
    train_from_file(base, settings.model_copy(update={"epochs": 2}))  # retrained in place
    with pytest.raises(ConfigError, match=r"other contents of: reward model .*must not change mid-run"):
        pipeline.run(cfg, 1)
