"""`ppo` command line: train, reward-model, sql, report, generate, doctor, serve, ui."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from ppo_core.config import ConfigError, PPOConfig, RewardModelSettings, load_config, parse_override

app = typer.Typer(help="PPO fine-tuning of language models on MLX, as a Prefect pipeline over Parquet.", no_args_is_help=True)

DEFAULT_ROOT = PPOConfig.model_fields["artifact_root"].default


@app.command()
def train(
    run: str = typer.Option("default", help="run name; re-using a name resumes/extends that run"),
    iterations: int = typer.Option(3, min=1, max=1000, help="iterations to run after the last completed one"),
    config: Optional[Path] = typer.Option(None, help="TOML or JSON config file"),
    set_: list[str] = typer.Option([], "--set", help="config override key=value (repeatable)"),
    workers: int = typer.Option(0, min=0, help="run rollout/attribute/value/evaluate as N shards on Ray workers (0: in this process)"),
    ray_address: Optional[str] = typer.Option(
        None, help="Ray cluster for the workers: 'auto', host:port or ray://host:10001 (default: a local Ray with --workers processes)"
    ),
    train_ranks: int = typer.Option(1, min=1, help="train data-parallel on N mx.distributed ranks"),
) -> None:
    """Run PPO iterations (one Prefect flow run; each phase is a task)."""
    from tasks.cluster import check_execution, check_reachable

    try:
        overrides = dict(parse_override(s) for s in set_)
        cfg = load_config(config, {**overrides, "run": run})  # fail fast, before Prefect or a model starts
        check_execution(workers, ray_address, train_ranks, cfg)
        if ray_address not in (None, "local"):
            check_reachable(ray_address)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    from flows.ppo import ppo

    summary = ppo(
        run=run, iterations=iterations, config=str(config) if config else None, overrides=overrides,
        workers=workers, ray_address=ray_address, train_ranks=train_ranks,
    )
    typer.echo(json.dumps(summary, indent=2))


def _emit(rel, fmt: str, output: Optional[Path]) -> None:
    if fmt == "table":
        rel.show(max_width=200, max_rows=100)
    elif fmt == "csv":
        rel.pl().write_csv(output or sys.stdout)
    elif fmt == "json":
        text = rel.pl().write_json()
        output.write_text(text) if output else typer.echo(text)
    elif fmt == "parquet":
        if output is None:
            raise typer.BadParameter("--format parquet needs --output FILE")
        rel.pl().write_parquet(output)
    else:
        raise typer.BadParameter(f"--format must be table, csv, json or parquet (got {fmt!r})")


_RM = RewardModelSettings.model_fields


@app.command("reward-model")
def reward_model_cmd(
    name: str = typer.Option(_RM["name"].default, help=_RM["name"].description),
    data: Path = typer.Option(_RM["data"].default, help=_RM["data"].description),
    epochs: int = typer.Option(_RM["epochs"].default, min=1),
    lr: float = typer.Option(_RM["lr"].default, min=0.0),
    batch_size: int = typer.Option(_RM["batch_size"].default, min=1, help=_RM["batch_size"].description),
    eval_fraction: float = typer.Option(_RM["eval_fraction"].default, min=0.01, max=0.9, help=_RM["eval_fraction"].description),
    set_: list[str] = typer.Option([], "--set", help="config override key=value (model, lora_*, seed, artifact_root)"),
) -> None:
    """Train a learned reward model (Bradley-Terry) on preference pairs; use it with --set reward=model:<path>."""
    settings = {"name": name, "data": str(data), "epochs": epochs, "lr": lr, "batch_size": batch_size,
                "eval_fraction": eval_fraction}
    try:
        overrides = dict(parse_override(s) for s in set_)
        load_config(overrides=overrides)
        RewardModelSettings.build(**settings)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    from flows.reward_model import reward_model

    result = reward_model(settings=settings, overrides=overrides)
    typer.echo(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=2))


@app.command()
def sql(
    query: Optional[str] = typer.Argument(None, help="SQL; omit it for an interactive shell"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root"),
    fmt: str = typer.Option("table", "--format", help="table | csv | json | parquet"),
    output: Optional[Path] = typer.Option(None, help="write the result here instead of stdout"),
) -> None:
    """Query the experience tables of every run with DuckDB.

    Views: rollouts, sa_pairs, rewards, values, advantages, metrics, eval, tokens
    (all per-token columns joined) and the macro state_text(run, iter, rollout_id, t).
    """
    import duckdb

    from ppo_core.query import connect

    con = connect(root)
    if query is None:
        _shell(con)
        return
    try:
        rel = con.sql(query)
    except duckdb.Error as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    if rel is not None:
        _emit(rel, fmt, output)


def _shell(con) -> None:
    import duckdb

    typer.echo("DuckDB over the artifact store. End statements with ';'. Ctrl-D to quit.")
    buf = ""
    while True:
        try:
            line = input("ppo> " if not buf else "...> ")
        except EOFError:
            typer.echo("")
            return
        buf += line + "\n"
        if not buf.rstrip().endswith(";"):
            continue
        try:
            rel = con.sql(buf)
            if rel is not None:
                rel.show(max_width=200, max_rows=100)
        except duckdb.Error as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
        buf = ""


@app.command()
def report(
    run: str = typer.Option("default", help="run name"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root"),
    iteration: Optional[int] = typer.Option(None, help="iteration of the advantage heatmap and eval samples (default: last)"),
    rollouts: int = typer.Option(6, min=2, max=200, help="rollouts shown token by token (half highest, half lowest score)"),
    output: Optional[Path] = typer.Option(None, help="default: report.html in the run's folder"),
) -> None:
    """Write a self-contained HTML report of a run: curves, numbers, advantage heatmaps, eval samples."""
    from ppo_core.report import build_report

    try:
        path = build_report(root, run, output=output, n_heatmap=rollouts, iteration=iteration)
    except (ValueError, OSError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    typer.echo(f"report: {path.resolve().as_uri()}")


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="one or more user prompts"),
    run: str = typer.Option("default", help="run whose registered model ppo-<run> is loaded"),
    version: str = typer.Option("latest", help="registered model version number, or 'latest'"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root (holds the run's config and the MLflow store)"),
    max_new_tokens: int = typer.Option(60, min=1, max=2048),
    temperature: float = typer.Option(0.0, min=0.0, max=10.0, help="0 = greedy"),
    seed: int = typer.Option(0, min=0),
) -> None:
    """Answer prompts with a registered policy (an MLflow model version of ppo-<run>)."""
    from ppo_core import registry
    from ppo_core.registry import RegistryError

    try:
        cfg = registry.run_config(run, root)
        model = registry.load_registered_policy(cfg, version)
    except (ConfigError, RegistryError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    answers = registry.generate_text(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    for prompt, answer in zip(prompts, answers):
        typer.echo(f"> {prompt}\n{answer}\n")


@app.command()
def doctor() -> None:
    """Check the fast BLAS, MLX matmul speed/accuracy and the default model."""
    from ppo_core.runtime import matmul_gflops, setup_blas

    state = setup_blas()
    typer.echo(f"OpenBLAS: {state.library or 'NOT LOADED'} (threads={state.threads})")
    if state.error:
        typer.secho(f"  warning: {state.error}", fg="yellow")
    gflops, err = matmul_gflops()
    typer.echo(f"MLX float32 matmul 1024^3: {gflops:.1f} GFLOP/s, max |error| vs numpy {err:.2e}")
    if gflops < 20:
        typer.secho("  slow: MLX is using the reference BLAS", fg="yellow")
    from ppo_core.models import ModelError, smollm2_gguf

    try:
        typer.echo(f"default model: {smollm2_gguf()}")
    except ModelError as exc:
        typer.secho(f"default model: {exc}", fg="red")


@app.command()
def serve(
    port: int = typer.Option(4200, help="Prefect server port"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback unless you mean it)"),
    ray_workers: int = typer.Option(0, min=0, help="also start a local Ray head with N worker processes"),
) -> None:
    """Start a Prefect server + worker with deployment ppo/iterate (and a Ray head); Ctrl-C stops them all."""
    from flows.serve import serve as run_serve

    raise typer.Exit(run_serve(host=host, port=port, ray_workers=ray_workers, log=lambda m: typer.echo(m)))


@app.command()
def ui(
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root"),
    port: int = typer.Option(5000),
    host: str = typer.Option("127.0.0.1"),
) -> None:
    """Start the MLflow UI on the project's tracking store (host-checked, same-origin only)."""
    import subprocess

    from flows.serve import is_loopback, mlflow_ui_command, reachable_host

    cfg = load_config(overrides={"artifact_root": str(root)})
    from ppo_core.track import EXPERIMENT, client

    if not is_loopback(host):
        typer.secho(f"WARNING: the MLflow UI on {host} has no login: anyone who reaches it reads every run and "
                    "model; put an authenticating proxy in front of it", fg="yellow", err=True)
    exp = client(cfg).get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        # MLflow 3 opens experiments on its GenAI pages; PPO runs live under "Model training"
        typer.echo(f"PPO runs, charts overlaid: http://{reachable_host(host)}:{port}/#/experiments/{exp.experiment_id}/runs"
                   "?workflowType=machine_learning&compareRunsMode=CHART")
    command, env = mlflow_ui_command(cfg, host, port, dict(os.environ))
    subprocess.run(command, env=env, check=False)


if __name__ == "__main__":
    app()
