"""Every run under an artifact root at a glance, and two runs side by side: read from the runs' own files.

A run's folder holds what ``ppo runs`` and ``ppo compare`` show: its pinned
config (``run.json``), one manifest per finished iteration with each phase's
statistics (the numbers MLflow's ``reward/score``, ``reward/kl``... are), and
its lock, held while a process trains it. Only the registered version and a
failed flow run's state come from the MLflow store, when there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from ppo_core import runs
from ppo_core.layout import RunLayout, mlflow_db, parse_run_label

# the per-iteration numbers a user compares first (MLflow metric names)
HEADLINE = ("reward/score", "reward/kl", "reward/reward", "evaluate/eval_score", "rollout/response_length")


@dataclass(frozen=True)
class RunSummary:
    run: str
    iterations: int  # finished, after iteration 0
    state: str  # running | finished | failed | stopped (an unfinished iteration, nobody training it) | new
    score: float | None
    kl: float | None
    eval_score: float | None
    version: int | None  # latest registered version of ppo-<run>


def run_names(root: Path) -> list[str]:
    """Runs under ``root`` (folders ``run=<name>`` holding a pinned config)."""
    names = (parse_run_label(p.name) for p in Path(root).glob("run=*") if (p / "run.json").is_file())
    return sorted(n for n in names if n is not None)


def iteration_metrics(layout: RunLayout) -> pl.DataFrame:
    """One row per finished iteration (0 included): every phase statistic under its MLflow metric name."""
    from ppo_core.pipeline import iteration_metrics as metrics_of

    rows = []
    for it in layout.completed_iterations():
        phases = runs.read_json(layout.manifest(it), f"the manifest of iteration {it}").get("phases", {})
        results = [{"phase": p, **v} for p, v in phases.items()]
        rows.append({"iteration": it, **{k: v for k, v in metrics_of(results).items() if not k.startswith("time/")}})
    return pl.DataFrame(rows) if rows else pl.DataFrame({"iteration": []}, schema={"iteration": pl.Int64})


def _mlflow_states(root: Path) -> tuple[dict[str, str], dict[str, int]]:
    """({run: MLflow status}, {run: latest registered version}) from the root's own store, if it has one."""
    if not mlflow_db(root).is_file():
        return {}, {}
    from ppo_core import track
    from ppo_core.config import load_config

    mlf = track.client(load_config(overrides={"artifact_root": str(root)}))
    exp = mlf.get_experiment_by_name(track.EXPERIMENT)
    states = {}
    if exp is not None:
        for r in mlf.search_runs([exp.experiment_id], max_results=10_000):
            states[r.data.tags.get(track.RUN_TAG, r.info.run_name)] = r.info.status
    versions: dict[str, int] = {}
    for mv in mlf.search_model_versions("name LIKE 'ppo-%'"):
        run = mv.name.removeprefix("ppo-")
        versions[run] = max(versions.get(run, 0), int(mv.version))
    return states, versions


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def list_runs(root: Path) -> list[RunSummary]:
    """Every run under ``root``, oldest name first."""
    states, versions = _mlflow_states(root)
    out = []
    for name in run_names(root):
        layout = RunLayout(root, name)
        complete = layout.completed_iterations()
        done = [i for i in complete if i > 0]
        last = iteration_metrics(layout).filter(pl.col("iteration") == max(done)).to_dicts()[0] if done else {}
        unfinished = set(layout.iterations()) - set(complete)
        if runs.lock_holder(layout) is not None:
            state = "running"
        elif states.get(name) == "FAILED":
            state = "failed"
        elif unfinished:
            state = "stopped"
        else:
            state = "finished" if done else "new"
        out.append(RunSummary(name, len(done), state, _number(last.get("reward/score")), _number(last.get("reward/kl")),
                              _number(last.get("evaluate/eval_score")), versions.get(name)))
    return out


def config_diff(root: Path, a: str, b: str) -> list[tuple[str, Any, Any]]:
    """(field, value in a, value in b) for every config field the two runs differ in."""
    ca, cb = (runs.read_json(RunLayout(root, r).run_json, "the run's pinned config", runs.PINNED_KEYS)["config"] for r in (a, b))
    return [(k, ca.get(k), cb.get(k)) for k in sorted(set(ca) | set(cb)) if k not in ("run",) and ca.get(k) != cb.get(k)]


def side_by_side(frames: dict[str, pl.DataFrame], metrics: tuple[str, ...] = HEADLINE) -> pl.DataFrame:
    """Per iteration, each metric of the first run next to the second's (columns ``<metric's last part>\\n<run>``).

    ``frames`` maps the two run names to their ``iteration_metrics``.
    """
    (a, fa), (b, fb) = frames.items()
    picked = [df.select("iteration", *[pl.col(m).alias(f"{m} {run}") for m in metrics if m in df.columns])
              for run, df in ((a, fa), (b, fb))]
    joined = picked[0].join(picked[1], on="iteration", how="full", coalesce=True).sort("iteration")
    ordered = [f"{m} {r}" for m in metrics for r in (a, b) if f"{m} {r}" in joined.columns]
    return joined.select("iteration", *ordered).rename({c: c.split("/")[-1].replace(" ", "\n") for c in ordered})
