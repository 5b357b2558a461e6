"""`ppo` command line: train, reward-model, runs, compare, sql, report, generate, export, doctor, serve, ui.

Every error a user can fix is one red line naming what is wrong, exit code 2
for a bad argument or config and 1 for a failure while running; ``--debug``
(on ``train``) shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer

import ppo_core  # noqa: F401  (loads OpenBLAS before mlx)
from ppo_core.config import REWARD_MODEL_FIELDS, ConfigError, PPOConfig, RewardModelSettings, check_known, load_config, parse_override

app = typer.Typer(help="PPO fine-tuning of language models on MLX, as a Prefect pipeline over Parquet.", no_args_is_help=True)

DEFAULT_ROOT = PPOConfig.model_fields["artifact_root"].default


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if text else type(exc).__name__


def _show_version(value: bool) -> None:
    if value:
        v = importlib.metadata.version
        typer.echo(f"ppo-mlx {v('ppo-mlx')} (mlx {v('mlx')}, mlx-lm {v('mlx-lm')}, prefect {v('prefect')}, mlflow {v('mlflow')})")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True, help="print the versions and exit"),
) -> None:
    """PPO fine-tuning of language models on MLX, as a Prefect pipeline over Parquet."""


def _overrides(items: list[str], run: str | None = None) -> dict:
    """``--set key=value`` items as a dict; a ``run`` key conflicts with the command's own ``--run``."""
    overrides = dict(parse_override(s) for s in items)
    if run is not None and "run" in overrides and overrides["run"] != run:
        raise ConfigError(f"--set run={overrides['run']} conflicts with --run {run}: name the run with --run only")
    return overrides


class _NoTraceback(logging.Filter):
    """Drops the traceback from Prefect's log of a failed flow or task run: the message stays."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True

    def __enter__(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


@app.command()
def train(
    run: str = typer.Option("default", help="run name; re-using a name resumes/extends that run"),
    iterations: Optional[int] = typer.Option(None, min=1, max=1000, help="iterations to run after the last completed one [default: 3]"),
    until: Optional[int] = typer.Option(
        None, min=1, help="train up to this iteration instead (re-running the same command after a crash finishes the same work)"
    ),
    config: Optional[Path] = typer.Option(None, help="TOML or JSON config file"),
    set_: list[str] = typer.Option([], "--set", help="config override key=value (repeatable; lists as a,b or JSON)"),
    workers: int = typer.Option(0, min=0, help="run rollout/attribute/value/evaluate as N shards on Ray workers (0: in this process)"),
    ray_address: Optional[str] = typer.Option(
        None, help="Ray cluster for the workers: 'auto', host:port or ray://host:10001 (default: a local Ray with --workers processes)"
    ),
    train_ranks: int = typer.Option(1, min=1, help="train data-parallel on N mx.distributed ranks"),
    debug: bool = typer.Option(False, "--debug", help="show the traceback of a failure"),
) -> None:
    """Run PPO iterations (one Prefect flow run; each phase is a task)."""
    from ppo_core.models import ModelError
    from ppo_core.runs import ArtifactIntegrityError, RunBusyError, preflight
    from tasks.cluster import check_execution, check_reachable

    if iterations is not None and until is not None:
        _fail("give --iterations (more after the last finished one) or --until (up to that one), not both")
    iterations = iterations or 3
    try:  # everything that can be checked before Prefect starts or a model loads
        overrides = _overrides(set_, run)
        cfg = load_config(config, {**overrides, "run": run})
        check_execution(workers, ray_address, train_ranks, cfg)
        preflight(cfg)
        if ray_address not in (None, "local"):
            check_reachable(ray_address)
    except (ValueError, ModelError, RunBusyError, ArtifactIntegrityError) as exc:  # ConfigError, PromptsError are ValueErrors
        if debug:
            raise
        _fail(_one_line(exc))
    except OSError as exc:  # a file the config names cannot be read (permissions, an unreadable device): name it
        if debug:
            raise
        _fail(f"cannot read {exc.filename}: {exc.strerror}" if exc.filename else _one_line(exc))
    from flows.ppo import ppo

    try:
        with contextlib.nullcontext() if debug else _NoTraceback():
            summary = ppo(
                run=run, iterations=iterations, config=str(config) if config else None, overrides=overrides,
                workers=workers, ray_address=ray_address, train_ranks=train_ranks, until=until,
            )
    except Exception as exc:
        if debug:
            raise
        typer.secho(f"error: {_one_line(exc)}", fg="red", err=True)
        again = f"ppo train --run {run} --until {until}" if until is not None else f"ppo train --run {run}"
        typer.echo(f"finished phases are kept: `{again}` resumes; --debug shows the traceback", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(summary, indent=2))


FORMATS = ("table", "csv", "json", "parquet")


def _output_format(fmt: Optional[str], output: Optional[Path]) -> str:
    """The --format given, else the one --output's suffix names, else table."""
    if fmt is None:
        if output is None:
            return "table"
        fmt = output.suffix.lstrip(".").lower()
        if fmt not in FORMATS[1:]:
            _fail(f"--output {output}: name a .csv, .json or .parquet file, or give --format")
    if fmt not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if output is not None:
        if fmt == "table":
            _fail("--output writes csv, json or parquet: give --format or a file name ending in one of them")
        if not output.parent.is_dir():
            _fail(f"--output {output}: folder {output.parent} does not exist")
    return fmt


def _emit(rel, fmt: str, output: Optional[Path], max_rows: Optional[int]) -> int:
    """Show or write the query's result, executing it once; returns its number of rows."""
    if fmt == "table":
        import duckdb

        result = rel.to_arrow_table()  # what show() would materialise anyway; the row count comes with it
        duckdb.from_arrow(result).show(max_width=200, max_rows=max_rows or 40)
        return result.num_rows
    df = (rel.limit(max_rows) if max_rows else rel).pl()
    try:
        if fmt == "csv":
            df.write_csv(output) if output else typer.echo(df.write_csv(), nl=False)
        elif fmt == "json":
            output.write_text(df.write_json()) if output else typer.echo(df.write_json())
        else:
            if output is None:
                _fail("--format parquet needs --output FILE")
            df.write_parquet(output)
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror}", 1)
    return df.height


def _views(con) -> list[str]:
    return [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall()]


def _print_tables(con) -> None:
    """``.tables``: each view and its columns."""
    for view in _views(con):
        cols = [r[0] for r in con.execute(f"DESCRIBE {view}").fetchall()]
        typer.echo(f"{view}: {', '.join(cols)}")


def _run_statement(con, statement: str, root: Path, fmt: str, output: Optional[Path], max_rows: Optional[int]) -> None:
    """One statement: `.tables`, an `explain` (its plan as plain text) or a query (its rows, and a hint for none)."""
    import duckdb

    from ppo_core.run_index import run_names

    text = statement.strip().rstrip(";").strip()
    if text == ".tables":
        _print_tables(con)
        return
    try:
        rel = con.sql(text)
        if rel is None:
            return
        if rel.columns == ["explain_key", "explain_value"]:
            for _, plan in rel.fetchall():
                typer.echo(plan)
            return
        empty = _emit(rel, fmt, output, max_rows) == 0
    except duckdb.CatalogException as exc:
        views = _views(con)
        raise ValueError(f"{_one_line(exc)} (tables here: {', '.join(views) if views else 'none'})") from None
    except duckdb.Error as exc:
        raise ValueError(_one_line(exc)) from None
    if empty:
        typer.secho(f"0 rows. Runs under {root}: {', '.join(run_names(root)) or 'none'}", fg="yellow", err=True)


@app.command()
def sql(
    query: Optional[str] = typer.Argument(None, help="SQL, or .tables; omit it for an interactive shell"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root"),
    fmt: Optional[str] = typer.Option(None, "--format", help="table | csv | json | parquet (default: from --output's suffix, else table)"),
    output: Optional[Path] = typer.Option(None, help="write the result to this file instead of stdout"),
    max_rows: Optional[int] = typer.Option(None, min=1, help="show/write at most this many rows (table default: 40)"),
) -> None:
    """Query the experience tables of every run with DuckDB.

    Views: rollouts, sa_pairs, rewards, values, advantages, metrics, eval, tokens
    (all per-token columns joined) and the macro state_text(run, iter, rollout_id, t).
    """
    from ppo_core.query import connect

    if not root.is_dir():
        _fail(f"artifact root {root} does not exist (--root)")
    fmt = _output_format(fmt, output)
    try:
        con = connect(root)
    except ValueError as exc:
        _fail(_one_line(exc))
    if query is None:
        _shell(con, root, max_rows)
        return
    if not _views(con) and query.strip().rstrip(";") != ".tables":
        _fail(f"no tables under artifact root {root} yet: `ppo train` writes them")
    try:
        _run_statement(con, query, root, fmt, output, max_rows)
    except ValueError as exc:
        _fail(str(exc))


def _shell(con, root: Path, max_rows: Optional[int]) -> None:
    typer.echo("DuckDB over the artifact store. End statements with ';'; .tables lists the views. Ctrl-D to quit.")
    buf = ""
    while True:
        try:
            line = input("ppo> " if not buf else "...> ")
        except EOFError:
            typer.echo("")
            return
        if not buf and line.strip() in (".tables", ".quit", ".exit"):
            if line.strip() != ".tables":
                return
            _print_tables(con)
            continue
        buf += line + "\n"
        if not buf.rstrip().endswith(";"):
            continue
        try:
            _run_statement(con, buf, root, "table", None, max_rows)
        except ValueError as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
        buf = ""


_RM = RewardModelSettings.model_fields


@app.command("reward-model")
def reward_model_cmd(
    name: str = typer.Option(_RM["name"].default, help=_RM["name"].description),
    data: Path = typer.Option(_RM["data"].default, help=_RM["data"].description),
    epochs: int = typer.Option(_RM["epochs"].default, min=1),
    lr: float = typer.Option(_RM["lr"].default, min=0.0),
    batch_size: int = typer.Option(_RM["batch_size"].default, min=1, help=_RM["batch_size"].description),
    eval_fraction: float = typer.Option(_RM["eval_fraction"].default, min=0.01, max=0.9, help=_RM["eval_fraction"].description),
    set_: list[str] = typer.Option([], "--set", help=f"config override key=value, one of: {', '.join(REWARD_MODEL_FIELDS)}"),
) -> None:
    """Train a learned reward model (Bradley-Terry) on preference pairs; use it with --set reward=model:<path>."""
    settings = {"name": name, "data": str(data), "epochs": epochs, "lr": lr, "batch_size": batch_size,
                "eval_fraction": eval_fraction}
    try:
        overrides = _overrides(set_)
        check_known(overrides, REWARD_MODEL_FIELDS, "--set field for a reward model")
        load_config(overrides=overrides)
        RewardModelSettings.build(**settings)
    except ConfigError as exc:
        _fail(_one_line(exc))
    from flows.reward_model import reward_model

    result = reward_model(settings=settings, overrides=overrides)
    typer.echo(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=2))


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
def sync(
    run: str = typer.Option("default", help="run name"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root"),
) -> None:
    """Log to MLflow what a run's flow runs could not (its server was away, a process was killed), training nothing.

    Every finished iteration MLflow lacks is logged from its manifest, the latest
    finished policy is registered (unless it is already a version), the report uploaded.
    """
    from ppo_core import pipeline, registry
    from ppo_core.registry import RegistryError
    from ppo_core.runs import ArtifactIntegrityError, RunBusyError
    from ppo_core.track import TrackingUnavailable

    try:
        cfg = registry.run_config(run, root)
        if not cfg.layout.run_json.is_file():
            _fail(f"no run '{run}' under {root}")
        summary = pipeline.sync(cfg, log=typer.echo)
    except (ConfigError, RegistryError, RunBusyError, ArtifactIntegrityError, TrackingUnavailable) as exc:
        _fail(_one_line(exc), 1 if isinstance(exc, TrackingUnavailable) else 2)
    typer.echo(json.dumps(summary, indent=2))


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
    from ppo_core.models import ModelError
    from ppo_core.registry import RegistryError
    from ppo_core.runs import ArtifactIntegrityError

    try:
        cfg = registry.run_config(run, root)
        mv = registry.policy_version(cfg, version)
        model = registry.load_registered_policy(cfg, mv.version)
    except (ConfigError, RegistryError, ModelError, ArtifactIntegrityError) as exc:
        _fail(_one_line(exc))
    typer.secho(f"# {mv.name} version {mv.version} (iteration {mv.tags.get('iteration', '?')} of run '{run}')", err=True, dim=True)
    answers = registry.generate_text(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    for prompt, answer in zip(prompts, answers):
        typer.echo(f"> {prompt}\n{answer}\n")


@app.command()
def export(
    out: Path = typer.Argument(..., help="new folder to write (must not exist, or be empty)"),
    run: str = typer.Option("default", help="run whose registered model ppo-<run> is exported"),
    version: str = typer.Option("latest", help="registered model version number, or 'latest'"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root (holds the run's config and the MLflow store)"),
    fuse: bool = typer.Option(False, "--fuse", help="write a standalone model with the adapter merged into its weights"),
) -> None:
    """Export a registered policy for mlx-lm: an adapter folder (adapters.safetensors + adapter_config.json) or, with --fuse, a model."""
    from ppo_core import registry
    from ppo_core.export import ExportError, export_adapter, export_fused
    from ppo_core.models import ModelError
    from ppo_core.registry import RegistryError
    from ppo_core.runs import ArtifactIntegrityError

    try:
        cfg = registry.run_config(run, root)
        done = (export_fused if fuse else export_adapter)(cfg, version, out)
    except (ConfigError, RegistryError, ModelError, ExportError, ArtifactIntegrityError) as exc:
        _fail(_one_line(exc))
    what = "fused model" if fuse else "mlx-lm adapter"
    typer.echo(f"{what} of ppo-{run} version {done.version} (iteration {done.iteration}): {done.path}")
    adapter = "" if fuse else f" --adapter-path {done.path}"
    typer.echo(f"try: mlx_lm.generate --model {done.base_model}{adapter} --prompt 'Hello' --max-tokens 60")


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, c in enumerate(columns):
        text = all(isinstance(r[i], str) for r in rows if r[i] is not None)
        table.add_column(c, justify="left" if text else "right", no_wrap=True)
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    console = Console()
    # piped or captured output has no width of its own: never truncate a number there
    Console(width=console.width if console.is_terminal else 250).print(table)


@app.command()
def runs(root: Path = typer.Option(DEFAULT_ROOT, help="artifact root")) -> None:
    """Every run under the artifact root: iterations done, state, last score, KL and eval, registered version."""
    from ppo_core.run_index import list_runs
    from ppo_core.runs import ArtifactIntegrityError

    if not root.is_dir():
        _fail(f"artifact root {root} does not exist (--root)")
    try:
        found = list_runs(root)
    except ArtifactIntegrityError as exc:
        _fail(_one_line(exc), 1)
    if not found:
        typer.echo(f"no runs under {root} yet: `ppo train --run NAME` starts one")
        return
    _print_table(f"runs under {root}", ["run", "iterations", "state", "score", "KL", "eval", "version"],
                 [[r.run, r.iterations, r.state, r.score, r.kl, r.eval_score, r.version] for r in found])


@app.command()
def compare(
    a: str = typer.Argument(..., help="a run name"),
    b: str = typer.Argument(..., help="another run name"),
    root: Path = typer.Option(DEFAULT_ROOT, help="artifact root"),
    metric: list[str] = typer.Option([], help="per-iteration metric to show, e.g. train/approx_kl (repeatable; default: score, KL, reward, eval, length)"),
) -> None:
    """Two runs side by side: their config differences, then metrics of each iteration."""
    from ppo_core.layout import RunLayout
    from ppo_core.run_index import HEADLINE, config_diff, iteration_metrics, run_names, side_by_side
    from ppo_core.runs import ArtifactIntegrityError

    known = run_names(root) if root.is_dir() else []
    missing = [r for r in (a, b) if r not in known]
    if missing:
        _fail(f"no run {', '.join(repr(m) for m in missing)} under {root}; runs: {', '.join(known) or 'none'}")
    try:
        frames = {r: iteration_metrics(RunLayout(root, r)) for r in (a, b)}
        diff = config_diff(root, a, b)
    except ArtifactIntegrityError as exc:
        _fail(_one_line(exc), 1)
    available = sorted({c for df in frames.values() for c in df.columns} - {"iteration"})
    unknown = [m for m in metric if m not in available]
    if unknown:
        _fail(f"no metric {', '.join(repr(m) for m in unknown)} in runs {a}, {b}; metrics: {', '.join(available)}")
    if diff:
        _print_table("config differences", ["field", a, b], [[k, json.dumps(x), json.dumps(y)] for k, x, y in diff])
    else:
        typer.echo("same config")
    df = side_by_side(frames, tuple(metric) or HEADLINE)
    _print_table("per iteration", df.columns, [list(r) for r in df.iter_rows()])


@app.command()
def doctor(root: Path = typer.Option(DEFAULT_ROOT, help="artifact root (where the converted model is kept)")) -> None:
    """Check the fast BLAS, MLX matmul speed/accuracy and the default model; ends with one verdict."""
    from ppo_core.runtime import matmul_gflops, setup_blas

    problems: list[str] = []
    state = setup_blas()
    typer.echo(f"OpenBLAS: {state.library or 'NOT LOADED'} (threads={state.threads})")
    if state.error:
        typer.secho(f"  warning: {state.error}", fg="yellow")
    gflops, err = matmul_gflops()
    typer.echo(f"MLX float32 matmul 1024^3: {gflops:.1f} GFLOP/s, max |error| vs numpy {err:.2e}")
    if gflops < 20:
        problems.append("MLX multiplies with the reference BLAS (~2 GFLOP/s): training would take hours; run `make setup`")
    if err > 1e-2:
        problems.append(f"MLX's matmul disagrees with numpy by {err:.2e}: the BLAS library is broken")
    from ppo_core.models import ModelError, smollm2_converted_dir, smollm2_gguf

    try:
        typer.echo(f"default model: {smollm2_gguf()}")
        converted = smollm2_converted_dir(root)
        if (converted / "model.safetensors").is_file():
            typer.echo(f"  converted: {converted}")
        else:
            typer.echo(f"  not converted yet: the first `ppo train` writes {converted} (about a minute)")
    except ModelError as exc:
        typer.secho(f"default model: {exc}", fg="red")
        problems.append("the default model (SmolLM2) is not installed: run `make setup`")
    if problems:
        typer.secho(f"NOT READY: {'; '.join(problems)}", fg="red")
        raise typer.Exit(1)
    typer.secho("ready: `ppo train` will run at full speed here", fg="green")


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
    from ppo_core.track import EXPERIMENT, client, first_screen

    if not is_loopback(host):
        typer.secho(f"WARNING: the MLflow UI on {host} has no login: anyone who reaches it reads every run and "
                    "model; put an authenticating proxy in front of it", fg="yellow", err=True)
    mlf = client(cfg)
    exp = mlf.get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        # MLflow 3 opens experiments on its GenAI pages; PPO runs live under "Model training"
        base = f"http://{reachable_host(host)}:{port}/#/experiments/{exp.experiment_id}"
        view = first_screen(mlf, exp.experiment_id)
        typer.echo(f"PPO runs, charts overlaid: {base}/runs?workflowType=machine_learning&compareRunsMode=CHART"
                   f"&viewStateShareKey={view}")
        latest = mlf.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
        if latest:  # a run page opens on its overview: its curves are on the model-metrics tab
            typer.echo(f"latest run '{latest[0].info.run_name}', its curves: {base}/runs/{latest[0].info.run_id}/model-metrics"
                       "?workflowType=machine_learning")
    command, env = mlflow_ui_command(cfg, host, port, dict(os.environ))
    # its own process group, stopped whole: MLflow's web worker must not outlive `ppo ui` killed by a signal
    proc = subprocess.Popen(command, env=env, start_new_session=True)

    def stop(*_args) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
    try:
        proc.wait()
    except KeyboardInterrupt:
        stop()
        proc.wait()


if __name__ == "__main__":
    app()
