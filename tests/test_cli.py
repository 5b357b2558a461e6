"""The `ppo` command line as a user meets it: fail fast in one line, list and compare runs, export to mlx-lm, SQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from ppo_core import pipeline, registry, runs
from ppo_core.config import PPOConfig

TINY = dict(batch_size=6, max_new_tokens=8, score_batch_size=4, ppo_epochs=2, num_minibatches=2,
            eval_size=4, eval_max_new_tokens=6, lora_layers=1)
PROMPTS = ["How was your day?", "Tell me about the sea."]


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    """Run 'a' (2 iterations, registered) and run 'b' (1 iteration, another KL coefficient) under one root."""
    root = tmp_path_factory.mktemp("cli") / "artifacts"
    a = PPOConfig(run="a", model=str(tiny_model_dir), artifact_root=root, **TINY)
    pipeline.run_tracked(a, 2)
    b = PPOConfig(run="b", model=str(tiny_model_dir), artifact_root=root, kl_coef=0.3, **TINY)
    pipeline.run_tracked(b, 1)
    return a, b


# ---------------------------------------------------------------- train fails fast, in one line


def _train(root: Path, model_dir: Path, *extra: str):
    return invoke("train", "--run", "t", "--set", f"artifact_root={root}", "--set", f"model={model_dir}",
                  "--set", "batch_size=4", *extra)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--set", "batch_size=4000"], "'batch_size': 4000 is larger than the prompt set"),
        (["--set", "model=/nonexistent/model"], "model directory /nonexistent/model does not exist"),
        (["--set", "prompts_path=/nonexistent/p.jsonl"], "/nonexistent/p.jsonl"),
        (["--set", "kl_cof=0.1"], "unknown config field 'kl_cof': did you mean 'kl_coef'?"),
        (["--set", "run=other"], "--set run=other conflicts with --run t"),
        (["--set", "lora_targets=q_proj,nope"], "unknown: ['nope']"),
    ],
    ids=["batch", "model", "prompts", "typo", "run", "list"],
)
def test_train_refuses_bad_input_in_one_line_before_a_flow_starts(tmp_path, tiny_model_dir, extra, expected):
    result = _train(tmp_path / "root", tiny_model_dir, *extra)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not list((tmp_path / "root").glob("run=*"))  # nothing of a run was written


def test_comma_separated_lists_are_accepted():
    from ppo_core.config import load_config, parse_override

    assert load_config(overrides=["lora_targets=q_proj, v_proj"]).lora_targets == ("q_proj", "v_proj")
    assert load_config(overrides=dict([parse_override('lora_targets=["k_proj"]')])).lora_targets == ("k_proj",)


def test_train_refuses_a_changed_config_and_a_busy_run_before_a_flow_starts(two_runs):
    a, _ = two_runs
    changed = invoke("train", "--run", "a", *[x for k, v in _cfg_overrides(a, kl_coef=0.7) for x in ("--set", f"{k}={v}")])
    assert changed.exit_code == 2 and "run 'a' was started with a different config (changed: kl_coef: 0.05 -> 0.7)" in changed.output
    with runs.run_lock(a):  # another process training it (flock: a second open file conflicts even in one process)
        busy = invoke("train", "--run", "a", *[x for k, v in _cfg_overrides(a) for x in ("--set", f"{k}={v}")])
    assert busy.exit_code == 2 and "run 'a' is being trained by pid" in busy.output
    assert a.layout.completed_iterations() == [0, 1, 2]


def _cfg_overrides(cfg: PPOConfig, **changes) -> list[tuple[str, str]]:
    fields = {k: v for k, v in cfg.to_json_dict().items() if k != "run" and v != PPOConfig.model_fields[k].default}
    return [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in {**fields, **changes}.items()]


def test_reward_model_set_refuses_fields_it_would_ignore(tmp_path):
    result = invoke("reward-model", "--set", "kl_coef=0.2", "--set", f"artifact_root={tmp_path}")
    assert result.exit_code == 2
    assert "unknown --set field for a reward model 'kl_coef'" in result.output and "lora_rank" in result.output


# ---------------------------------------------------------------- runs, compare, report


def test_runs_lists_every_run_with_its_state_and_last_numbers(two_runs):
    a, b = two_runs
    result = invoke("runs", "--root", a.artifact_root)
    assert result.exit_code == 0, result.output
    rows = {cells[0]: cells for cells in (line.split() for line in result.output.splitlines()) if cells and cells[0] in ("a", "b")}
    score = json.loads(a.layout.manifest(2).read_text())["phases"]["reward"]["stats"]["score"]
    assert rows["a"][:4] == ["a", "2", "finished", f"{score:.4g}"] and rows["a"][-1] == "1"
    assert rows["b"][:3] == ["b", "1", "finished"]

    empty = invoke("runs", "--root", a.artifact_root.parent / "nothing-here")
    assert empty.exit_code == 2 and "does not exist" in empty.output


def test_compare_shows_the_config_difference_and_metrics_side_by_side(two_runs):
    a, _ = two_runs
    result = invoke("compare", "a", "b", "--root", a.artifact_root)
    assert result.exit_code == 0, result.output
    assert any("kl_coef" in line and "0.05" in line and "0.3" in line for line in result.output.splitlines())
    header = [line.split() for line in result.output.splitlines() if line.split()[:1] == ["iteration"]]
    assert header == [["iteration", "a", "b", "a", "b", "a", "b", "a", "b", "a", "b"]]
    iteration_2 = [line.split() for line in result.output.splitlines() if line.split()[:1] == ["2"]][0]
    assert iteration_2[2] == "-"  # run b has no iteration 2
    only = invoke("compare", "a", "b", "--root", a.artifact_root, "--metric", "train/approx_kl")
    assert only.exit_code == 0 and "approx_kl" in only.output and "eval_score" not in only.output
    bogus = invoke("compare", "a", "b", "--root", a.artifact_root, "--metric", "train/aprox_kl")
    assert bogus.exit_code == 2 and "no metric 'train/aprox_kl'" in bogus.output and "train/approx_kl" in bogus.output
    missing = invoke("compare", "a", "zzz", "--root", a.artifact_root)
    assert missing.exit_code == 2 and "no run 'zzz'" in missing.output and "runs: a, b" in missing.output


def test_report_explains_that_iteration_0_has_no_token_tables(two_runs):
    a, _ = two_runs
    result = invoke("report", "--run", "a", "--root", a.artifact_root, "--iteration", "0")
    assert result.exit_code == 2
    assert "iteration 0 is the starting checkpoint" in result.output and "iterations with them: 1" in result.output


# ---------------------------------------------------------------- sql


def test_sql_output_format_follows_the_file_name_and_max_rows(two_runs, tmp_path):
    a, _ = two_runs
    out = tmp_path / "rows.csv"
    result = invoke("sql", "select run, iter, rollout_id from rollouts order by 1, 2, 3", "--root", a.artifact_root,
                    "--output", out, "--max-rows", "3")
    assert result.exit_code == 0, result.output
    assert out.read_text().splitlines() == ["run,iter,rollout_id", "a,1,0", "a,1,1", "a,1,2"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--output", "{tmp}/missing/x.csv"], "folder {tmp}/missing does not exist"),
        (["--output", "{tmp}/x.txt"], "name a .csv, .json or .parquet file"),
        (["--format", "xml"], "--format must be one of table, csv, json, parquet"),
        (["--format", "table", "--output", "{tmp}/x.csv"], "--output writes csv, json or parquet"),
    ],
    ids=["missing-dir", "suffix", "format", "table-to-file"],
)
def test_sql_bad_output_options_are_one_line(two_runs, tmp_path, args, expected):
    a, _ = two_runs
    result = invoke("sql", "select 1", "--root", a.artifact_root, *[x.format(tmp=tmp_path) for x in args])
    assert result.exit_code == 2 and expected.format(tmp=tmp_path) in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_sql_names_a_missing_root_an_empty_one_a_missing_table_and_the_runs_there(two_runs, tmp_path):
    a, _ = two_runs
    missing = invoke("sql", "select 1", "--root", tmp_path / "nope")
    assert missing.exit_code == 2 and "artifact root" in missing.output and "does not exist" in missing.output
    empty = invoke("sql", "select * from rollouts", "--root", tmp_path)
    assert empty.exit_code == 2 and "no tables under artifact root" in empty.output
    no_table = invoke("sql", "select * from rollout", "--root", a.artifact_root)
    assert no_table.exit_code == 2 and "tables here: " in no_table.output and "rollouts" in no_table.output
    no_rows = invoke("sql", "select * from rollouts where run = 'nope'", "--root", a.artifact_root)
    assert no_rows.exit_code == 0 and "0 rows. Runs under" in no_rows.output and ": a, b" in no_rows.output


def test_sql_tables_and_plain_text_plans(two_runs):
    a, _ = two_runs
    tables = invoke("sql", ".tables", "--root", a.artifact_root)
    assert tables.exit_code == 0 and any(line.startswith("rollouts: run, iter") or line.startswith("rollouts: ") for line in tables.output.splitlines())
    plan = invoke("sql", "explain select count(*) from rollouts where run = 'a'", "--root", a.artifact_root)
    assert plan.exit_code == 0, plan.output
    assert "explain_key" not in plan.output and "READ_PARQUET" in plan.output.upper().replace(" ", "_")


# ---------------------------------------------------------------- export to mlx-lm, version, doctor


def _mlx_lm_generate(model: Path, prompt: str, adapter: Path | None = None) -> str:
    args = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt", prompt,
            "--max-tokens", "8", "--temp", "0.0", "--verbose", "False"]
    if adapter is not None:
        args += ["--adapter-path", str(adapter)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_export_writes_an_adapter_and_a_fused_model_that_mlx_lm_generates_with(two_runs, tmp_path):
    a, _ = two_runs
    expected = registry.generate_text(registry.load_registered_policy(registry.run_config("a", a.artifact_root), 1),
                                      PROMPTS, max_new_tokens=8)
    out = tmp_path / "adapter"
    result = invoke("export", out, "--run", "a", "--root", a.artifact_root)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["num_layers"] == 1 and config["lora_parameters"]["scale"] == a.lora_alpha / a.lora_rank
    base = Path(a.model)
    for prompt, answer in zip(PROMPTS, expected):
        assert _mlx_lm_generate(base, prompt, out) == answer.strip()

    fused = tmp_path / "fused"
    result = invoke("export", fused, "--run", "a", "--root", a.artifact_root, "--fuse")
    assert result.exit_code == 0, result.output
    assert (fused / "config.json").is_file() and not list(tmp_path.glob(".fused.*"))
    for prompt, answer in zip(PROMPTS, expected):
        assert _mlx_lm_generate(fused, prompt) == answer.strip()

    again = invoke("export", out, "--run", "a", "--root", a.artifact_root)
    assert again.exit_code == 2 and "is not an empty folder" in again.output
    missing = invoke("export", tmp_path / "x", "--run", "a", "--root", a.artifact_root, "--version", "7")
    assert missing.exit_code == 2 and "no version 7" in missing.output and not (tmp_path / "x").exists()


def test_version_and_generate_says_what_it_loaded(two_runs):
    a, _ = two_runs
    version = invoke("--version")
    assert version.exit_code == 0 and version.output.startswith("ppo-mlx ") and "mlx " in version.output
    result = invoke("generate", PROMPTS[0], "--run", "a", "--root", a.artifact_root, "--max-new-tokens", "3")
    assert result.exit_code == 0 and "ppo-a version 1 (iteration 2 of run 'a')" in result.output


def test_doctor_ends_with_one_verdict(tmp_path):
    result = invoke("doctor", "--root", tmp_path)
    last = result.output.strip().splitlines()[-1]
    assert (result.exit_code, last.split(":")[0]) in ((0, "ready"), (1, "NOT READY"))
    assert "converted" in result.output
