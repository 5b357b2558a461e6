"""MLflow tracking: the store, one MLflow run per PPO run, its metrics and artifacts.

One MLflow run per PPO run (tag ``ppo.run``), re-attached on resume; params are
the whole config; iteration metrics use step = iteration. With
``ppo_core.registry`` (the model registry) the only modules that import mlflow.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from ppo_core.config import PPOConfig
from ppo_core.faults import failpoint, scope
from ppo_core.layout import iter_label, mlflow_db, mlruns_dir

EXPERIMENT = "ppo"
RUN_TAG = "ppo.run"


def tracking_uri(cfg: PPOConfig) -> str:
    """MLFLOW_TRACKING_URI if set (a server), else an embedded SQLite store under the artifact root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{mlflow_db(cfg.artifact_root).resolve()}"


def shareable_uri(uri: str) -> str:
    """``uri`` without credentials: no user:password, no query (where drivers take passwords), for text others read."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not parts.netloc:  # sqlite:////path, postgresql:///db?password=...: keep the text up to the query
        return uri.split("?", 1)[0].split("#", 1)[0]
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer; the artifact store keeps everything it would have been told."""


# MLflow's REST client retries a refused connection 7 times with a doubling back-off (minutes per call);
# a run that keeps training while its server is away asks once or twice, then catches up later
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def check_reachable(cfg: PPOConfig, timeout: float = 5.0) -> None:
    """Raise ``TrackingUnavailable`` when the tracking URI is a server that does not answer ``/health``.

    Asked the way MLflow's client asks (``requests``, with MLFLOW_TRACKING_INSECURE_TLS,
    MLFLOW_TRACKING_SERVER_CERT_PATH or REQUESTS_CA_BUNDLE for a server behind a private CA).
    """
    import requests

    uri = tracking_uri(cfg)
    if not uri.startswith(("http://", "https://")):
        return  # a local store (SQLite file, folder) is as available as the artifact root
    verify: bool | str = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        verify = False
    try:
        answer = requests.get(f"{uri.rstrip('/')}/health", timeout=timeout, verify=verify)
    except requests.RequestException as exc:
        raise TrackingUnavailable(f"the MLflow tracking server {shareable_uri(uri)} is unreachable ({_reason(exc)})") from None
    if answer.status_code >= 500:  # it answers (a proxy may not know /health, a 4xx): available
        raise TrackingUnavailable(f"the MLflow tracking server {shareable_uri(uri)} is unreachable (HTTP {answer.status_code})")


def _reason(exc: BaseException) -> str:
    """The innermost cause of a connection error ('[Errno 111] Connection refused'), not urllib3's whole chain."""
    while exc.__context__ is not None and exc.__context__ is not exc:
        exc = exc.__context__
    text = str(exc)
    return text.split(": ", 1)[-1] if "Errno" in text and ": [Errno" in text else text


def unavailable(cfg: PPOConfig, exc: BaseException) -> TrackingUnavailable | None:
    """``exc`` as ``TrackingUnavailable`` when it came from a tracking server that is away, else None."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, TrackingUnavailable):
        return exc
    # MLflow's REST client wraps a failed connection as "API request to <url> failed with exception <e>"
    if isinstance(exc, (requests.ConnectionError, requests.Timeout)) or (
        isinstance(exc, MlflowException) and re.match(r"API request to \S+ failed with (timeout )?exception", str(exc))
    ):
        return TrackingUnavailable(f"the MLflow tracking server {shareable_uri(tracking_uri(cfg))} is unreachable "
                                   f"({' '.join(str(exc).split())[-300:]})")
    if not isinstance(exc, (MlflowException, OSError)):
        return None
    try:
        check_reachable(cfg)
    except TrackingUnavailable as away:
        return away
    return None  # the server answers: the error is about the request, not the connection


def registry_uri(cfg: PPOConfig) -> str:
    """MLFLOW_REGISTRY_URI if set, else the tracking store (SQL stores hold the registry too)."""
    return os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri(cfg)


def client(cfg: PPOConfig):
    """An MlflowClient bound to this config's store.

    Never ``mlflow.set_tracking_uri``: it also exports MLFLOW_TRACKING_URI into
    the environment, so one run's store would capture every later run in the
    process (a worker serving several artifact roots, or a test session).
    """
    logging.getLogger("alembic").setLevel(logging.WARNING)
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow import MlflowClient

    cfg.artifact_root.mkdir(parents=True, exist_ok=True)
    # the registry is named explicitly too, so a process-global mlflow.set_registry_uri cannot redirect it
    return MlflowClient(tracking_uri=tracking_uri(cfg), registry_uri=registry_uri(cfg))


def _experiment_id(cfg: PPOConfig, mlf, name: str = EXPERIMENT) -> str:
    exp = mlf.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return mlf.create_experiment(name, artifact_location=mlruns_dir(cfg.artifact_root).resolve().as_uri())


def _flat_params(cfg: PPOConfig) -> dict[str, str]:
    return {k: str(v) for k, v in cfg.to_json_dict().items()}


def ensure_run(cfg: PPOConfig) -> str:
    """The MLflow run id of PPO run ``cfg.run``, created on first use."""
    from mlflow.entities import Param

    mlf = client(cfg)
    exp_id = _experiment_id(cfg, mlf)
    found = mlf.search_runs([exp_id], filter_string=f"tags.`{RUN_TAG}` = '{cfg.run}'", max_results=1)
    if found and found[0].data.params:
        return found[0].info.run_id
    # a process killed between creating the run and logging its params left it without them: log them now
    run_id = found[0].info.run_id if found else mlf.create_run(exp_id, run_name=cfg.run, tags={RUN_TAG: cfg.run}).info.run_id
    failpoint("mlflow.run_created")
    mlf.log_batch(run_id, params=[Param(k, v) for k, v in _flat_params(cfg).items()])
    return run_id


def last_logged_iteration(cfg: PPOConfig) -> int:
    """The last iteration whose metrics the MLflow run holds (-1: none yet)."""
    return _last_logged(client(cfg), ensure_run(cfg))


def _last_logged(mlf, run_id: str) -> int:
    logged = mlf.get_run(run_id).data.tags.get("last_iteration")
    return int(logged) if logged is not None else -1


def log_iteration(
    cfg: PPOConfig, iteration: int, metrics: dict[str, float], step_rows: list[dict[str, Any]], timestamp_ms: int
) -> None:
    """Per-iteration metrics at step=iteration; per-optimiser-step metrics at a global step.

    ``timestamp_ms`` is fixed by the iteration (when it finished), never the time of logging: MLflow's SQL
    store drops a metric equal in key, value, step and timestamp to one it holds, so a process killed in
    the middle of logging an iteration and the one that logs it again leave one copy of every point.
    """
    from mlflow.entities import Metric

    layout = cfg.layout
    mlf = client(cfg)
    run_id = ensure_run(cfg)
    if _last_logged(mlf, run_id) >= iteration:
        return  # a resumed run re-finalising an iteration must not duplicate its steps
    with scope(f"{iter_label(iteration)}/mlflow"):
        batch = [Metric(k, float(v), timestamp_ms, iteration) for k, v in metrics.items()]
        for row in step_rows:
            gstep = int(row["global_step"])
            # an adapter an iteration did not train (value warm-up, critic-free estimators) has no step metrics
            keys = ("policy_loss", "value_loss", "approx_kl", "clip_fraction")
            batch += [Metric(f"step/{k}", float(row[k]), timestamp_ms, gstep) for k in keys if row.get(k) is not None]
        for i in range(0, len(batch), 900):  # MLflow caps a batch at 1000 entities
            mlf.log_batch(run_id, metrics=batch[i : i + 900])
            failpoint("mlflow.metrics")
        mlf.set_tag(run_id, f"iter.{iteration:04d}.parquet", str(layout.iter_dir(iteration).resolve()))
        for path in layout.checkpoint(iteration).adapter_files():
            mlf.log_artifact(run_id, str(path), artifact_path=adapter_artifact_dir(iteration))
            failpoint("mlflow.artifact", path.name)
        _log_table_inputs(cfg, mlf, run_id, iteration)
        failpoint("mlflow.inputs")
        eval_table = layout.table(iteration, "eval")
        if eval_table.is_file():
            import pyarrow.parquet as pq

            samples = pq.read_table(eval_table, columns=["prompt_id", "prompt", "response", "score"])
            mlf.log_table(run_id, data=samples.to_pandas(), artifact_file=f"samples/{iter_label(iteration)}.json")
            failpoint("mlflow.samples")
        # last: an iteration counts as logged only once everything above is
        mlf.set_tag(run_id, "last_iteration", str(iteration))


# What the chart view of the PPO experiment shows first: the curves a PPO user reads before any other
# (MLflow lists metric sections alphabetically, so advantage/, attribute/ would come first). The filter is
# the chart view's own search box, a regular expression: clearing it shows every chart.
FIRST_SCREEN_KEY = "ppo-first-screen"
FIRST_SCREEN_CHARTS = r"^(reward/(score|kl|reward)|evaluate/eval_score)$"


def first_screen(mlf, experiment_id: str) -> str:
    """Save the PPO first screen as a shared view of the experiment; returns its ``viewStateShareKey``.

    MLflow's UI opens a view saved in experiment tag ``mlflow.sharedViewState.<key>`` (plain JSON of its
    UI state) when the URL names the key.
    """
    state = json.dumps({"chartsSearchFilter": FIRST_SCREEN_CHARTS, "hideEmptyCharts": True})
    mlf.set_experiment_tag(experiment_id, f"mlflow.sharedViewState.{FIRST_SCREEN_KEY}", state)
    return FIRST_SCREEN_KEY


def log_report(cfg: PPOConfig, path: Path) -> None:
    """The run's HTML report as artifact ``report.html`` (replaced by each flow run); MLflow's viewer shows it."""
    client(cfg).log_artifact(ensure_run(cfg), str(path))
    failpoint("mlflow.report")


def adapter_artifact_dir(iteration: int) -> str:
    """Run-relative artifact folder holding an iteration's adapters."""
    return f"adapters/{iter_label(iteration)}"


def _log_table_inputs(cfg: PPOConfig, mlf, run_id: str, iteration: int) -> None:
    """Record each experience table as an MLflow dataset input: source = its path, digest = its hash.

    The manifest already holds the content hashes, so no table is read here.
    """
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    manifest_path = cfg.layout.manifest(iteration)
    if not manifest_path.is_file():
        return
    artifacts = json.loads(manifest_path.read_text())["artifacts"]
    inputs = []
    for rel, digest in sorted(artifacts.items()):
        if not rel.endswith(".parquet"):
            continue
        path = cfg.layout.run_dir / rel
        ds = MetaDataset(source=LocalArtifactDatasetSource(str(path.resolve())), name=f"{path.stem}@{iter_label(iteration)}", digest=digest[:16])
        inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")]))
    if inputs:
        mlf.log_inputs(run_id, datasets=inputs)


def set_status(cfg: PPOConfig, status: str, reason: str | None = None) -> None:
    """status: RUNNING, FINISHED or FAILED (with the reason as a tag)."""
    mlf = client(cfg)
    run_id = ensure_run(cfg)
    if reason:
        mlf.set_tag(run_id, "failure_reason", reason[:5000])
    if status == "RUNNING":
        mlf.update_run(run_id, status="RUNNING")
    else:
        mlf.set_terminated(run_id, status=status)
    failpoint("mlflow.status", status)


def run_metrics(cfg: PPOConfig) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} of the PPO run (for tests and reports)."""
    mlf = client(cfg)
    run = mlf.get_run(ensure_run(cfg))
    return {k: [(m.step, m.value) for m in mlf.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}


def log_reward_model(cfg: PPOConfig, name: str, params: dict[str, Any], result: dict[str, Any]) -> str:
    """One MLflow run per reward-model training in experiment 'reward-model'."""
    from mlflow.entities import Metric, Param

    mlf = client(cfg)
    run = mlf.create_run(_experiment_id(cfg, mlf, "reward-model"), run_name=name, tags={"reward_model.name": name})
    now = int(time.time() * 1000)
    flat = {**{k: str(v) for k, v in params.items()}, **{k: str(v) for k, v in cfg.to_json_dict().items() if k.startswith("lora") or k in ("model", "seed")}}
    metrics = [Metric(k, float(row[k]), now, int(row["epoch"])) for row in result["history"] for k in ("loss", "train_accuracy", "eval_accuracy")]
    metrics += [Metric(k, float(result[k]), now, 0) for k in ("train_pairs", "eval_pairs")]
    mlf.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in flat.items()])
    mlf.log_artifact(run.info.run_id, result["path"], artifact_path="reward_model")
    mlf.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id
