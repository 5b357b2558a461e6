"""The `ppo` Prefect flow end to end on the tiny model: tasks, resume, MLflow, SQL CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.ppo import ppo
from ppo_core import track
from ppo_core.config import ConfigError, load_config


def _overrides(cfg) -> dict:
    keep = ("model", "artifact_root", "batch_size", "max_new_tokens", "score_batch_size", "ppo_epochs",
            "num_minibatches", "eval_size", "eval_max_new_tokens")
    return {k: str(v) if k in ("model", "artifact_root") else v for k, v in cfg.to_json_dict().items() if k in keep}


@pytest.fixture
def flow_overrides(tiny_cfg):
    return _overrides(tiny_cfg())


pytestmark = pytest.mark.usefixtures("prefect_server")


def test_flow_runs_resumes_and_tracks(flow_overrides, tmp_path):
    summary = ppo(run="flowtest", iterations=2, overrides=flow_overrides)
    assert sorted(summary["iterations"]) == [1, 2]
    cfg = load_config(overrides={**flow_overrides, "run": "flowtest"})
    assert cfg.layout.completed_iterations() == [0, 1, 2]

    # MLflow: one run, per-iteration metrics at step = iteration, FINISHED
    history = track.run_metrics(cfg)
    assert [s for s, _ in history["reward/score"]] == [1, 2]
    assert [s for s, _ in history["evaluate/eval_score"]] == [0, 1, 2]
    steps = [s for s, _ in history["step/policy_loss"]]
    assert steps == sorted(set(steps)) and len(steps) == 2 * cfg.ppo_epochs * cfg.num_minibatches

    # running again extends the run by one iteration; the MLflow run is re-attached, not duplicated
    summary = ppo(run="flowtest", iterations=1, overrides=flow_overrides)
    assert cfg.layout.completed_iterations() == [0, 1, 2, 3]
    mlf = track.client(cfg)
    runs = mlf.search_runs([mlf.get_experiment_by_name(track.EXPERIMENT).experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = track.run_metrics(cfg)
    assert [s for s, _ in history["reward/score"]] == [1, 2, 3]
    run = mlf.get_run(runs[0].info.run_id)
    names = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert {"rollouts@iter=0001", "advantages@iter=0003", "sa_pairs@iter=0002"} <= names
    digests = {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
    manifest1 = json.loads(cfg.layout.manifest(1).read_text())
    assert digests["rollouts@iter=0001"] == manifest1["artifacts"]["iter=0001/rollouts.parquet"][:16]
    artifacts = {a.path for a in mlf.list_artifacts(runs[0].info.run_id, "samples")}
    assert "samples/iter=0003.json" in artifacts
    manifest = json.loads(cfg.layout.manifest(3).read_text())
    assert manifest["phases"]["rollout"]["cached"] is False

    # the HTML report is rebuilt by each flow run (now covering iterations 0-3) and logged on the MLflow run
    report = cfg.layout.report
    assert summary["report"] == str(report) and '<b id="iterations">0\u20133</b>' in report.read_text()
    logged = mlf.download_artifacts(runs[0].info.run_id, "report.html", str(tmp_path))
    assert Path(logged).read_bytes() == report.read_bytes()

    # `ppo sql` answers over the artifact root
    result = CliRunner().invoke(
        app, ["sql", "select iter, count(*) as n from advantages group by 1 order by 1", "--root", str(cfg.artifact_root), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["iter"] for r in rows] == [1, 2, 3] and all(r["n"] > 0 for r in rows)


def test_changed_config_is_refused_for_an_existing_run(flow_overrides):
    ppo(run="pinned", iterations=1, overrides=flow_overrides)
    with pytest.raises(ConfigError, match=r"different config \(changed: kl_coef"):
        ppo(run="pinned", iterations=1, overrides={**flow_overrides, "kl_coef": 0.5})


def test_cli_rejects_bad_config_before_anything_runs(tmp_path):
    result = CliRunner().invoke(app, ["train", "--run", "x", "--set", "gamma=2", "--set", f"artifact_root={tmp_path}"])
    assert result.exit_code == 2
    assert "gamma" in result.output and "less than or equal to 1" in result.output
    assert not any(tmp_path.iterdir())


def test_failed_flow_marks_the_mlflow_run_failed_with_the_reason(flow_overrides, monkeypatch):
    from ppo_core import phases

    import numpy as np

    calls = []

    class Exploding:
        name = "exploding"

        def __call__(self, prompts, responses, n_tokens):
            calls.append(1)
            if len(calls) == 1:  # the baseline evaluation (iteration 0) still works
                return np.zeros(len(responses))
            raise RuntimeError("scorer offline")

    monkeypatch.setattr(phases, "make_reward", lambda *a, **k: Exploding())
    with pytest.raises(Exception, match="scorer offline"):
        ppo(run="doomed", iterations=1, overrides=flow_overrides)
    cfg = load_config(overrides={**flow_overrides, "run": "doomed"})
    mlf = track.client(cfg)
    exp_id = mlf.get_experiment_by_name(track.EXPERIMENT).experiment_id
    [run] = mlf.search_runs([exp_id], filter_string="tags.`ppo.run` = 'doomed'")
    assert run.info.status == "FAILED"
    assert "scorer offline" in run.data.tags["failure_reason"]
    # the phases before the failure are kept, so a re-run resumes from them
    assert (cfg.layout.table(1, "sa_pairs")).is_file()
    assert not (cfg.layout.table(1, "rewards")).exists()


def test_ppo_train_prints_a_failure_inside_the_flow_in_one_line(flow_overrides, monkeypatch, caplog):
    from ppo_core import phases

    def exploding(*args, **kwargs):
        raise RuntimeError("scorer offline")

    monkeypatch.setattr(phases, "make_reward", exploding)
    args = ["train", "--run", "oneline", "--iterations", "1"]
    args += [x for k, v in flow_overrides.items() for x in ("--set", f"{k}={v}")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "error: scorer offline" in result.output and "`ppo train --run oneline` resumes" in result.output
    assert "Traceback" not in result.output
    prefect_logs = [r for r in caplog.records if r.name.startswith("prefect")]
    assert any("scorer offline" in r.getMessage() for r in prefect_logs)  # Prefect still says what failed...
    assert not any(r.exc_info for r in prefect_logs)  # ...without the traceback

    caplog.clear()
    debug = CliRunner().invoke(app, [*args, "--debug"])
    assert debug.exit_code == 1 and isinstance(debug.exception, RuntimeError)
    assert any(r.exc_info for r in caplog.records if r.name.startswith("prefect"))


def test_progress_lines_reach_the_prefect_task_run_logs(flow_overrides, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from ppo_core import progress

    monkeypatch.setattr(progress, "EVERY_SECONDS", 0.0)
    state = ppo(run="progress", iterations=1, overrides=flow_overrides, return_state=True)
    APILogHandler().flush()  # the log worker is process-wide: send what is queued
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    messages = [(log.task_run_id is not None, log.message) for log in logs]
    assert any(in_task and m.startswith("rollout of iteration 1: ") for in_task, m in messages)
    assert any(in_task and m.startswith("training: ") for in_task, m in messages)


def test_a_resumed_flow_logs_every_phase_time_and_marks_the_dead_flow_run_crashed(flow_overrides, monkeypatch):
    """A flow run killed mid-iteration: the next one resumes, logs the reused phases' times, and closes the dead one."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from ppo_core import phases

    cfg = load_config(overrides={**flow_overrides, "run": "heir"})
    original, calls = phases.make_reward, []

    def dies_at_iteration_1(*args, **kwargs):  # iteration 0's evaluation scores; iteration 1's reward phase dies
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("killed")
        return original(*args, **kwargs)

    monkeypatch.setattr(phases, "make_reward", dies_at_iteration_1)
    with pytest.raises(Exception, match="killed"):
        ppo(run="heir", iterations=1, overrides=flow_overrides)
    monkeypatch.setattr(phases, "make_reward", original)
    assert cfg.layout.table(1, "sa_pairs").is_file() and not cfg.layout.table(1, "rewards").exists()

    # what a SIGKILLed flow run leaves: its state RUNNING in the server and its name in the run's lock
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(ppo)
        dead = client.create_flow_run(ppo, name="killed-run")
        client.set_flow_run_state(dead.id, Running(), force=True)
    cfg.layout.lock.write_text(f"pid 999999 on host gone, flow run {dead.id}")
    stale = cfg.layout.iter_dir(0) / ".eval.x1.tmp.parquet"
    stale.write_bytes(b"half")

    ppo(run="heir", iterations=1, overrides=flow_overrides)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(dead.id).state
    assert state.type.value == "CRASHED" and "died holding the run's lock" in state.message
    assert not stale.exists()
    # the phases reused from the killed flow run are timed like the ones that ran now
    logged = track.run_metrics(cfg)
    for phase in ("rollout", "attribute", "reward", "value", "advantage", "train"):
        record = json.loads(cfg.layout.phase_record(1, phase).read_text())
        assert logged[f"time/{phase}_seconds"] == [(1, pytest.approx(record["seconds"]))], phase
    assert flow_id is not None


def test_a_critic_free_run_through_the_flow_skips_the_value_task(flow_overrides, vowel_reward):
    """RLOO with 2 samples per prompt: no value task, the MLflow run has no value loss, the report builds."""
    overrides = {**flow_overrides, "advantage_estimator": "rloo", "samples_per_prompt": 2, "batch_size": 3,
                 "reward": vowel_reward, "temperature": 1.5}
    summary = ppo(run="flow-rloo", iterations=1, overrides=overrides)
    cfg = load_config(None, {**overrides, "run": "flow-rloo"})
    manifest = json.loads(cfg.layout.manifest(1).read_text())
    assert "value" not in manifest["phases"] and "train" in manifest["phases"]
    logged = track.run_metrics(cfg)
    assert "train/policy_loss" in logged and "step/policy_loss" in logged
    assert not {"train/value_loss", "step/value_loss", "value/value", "advantage/explained_variance"} & set(logged)
    assert Path(summary["report"]).is_file()
