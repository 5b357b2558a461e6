"""MLflow tracking: the only module that imports mlflow.

One MLflow run per PPO run (tag ``ppo.run``), re-attached on resume; params are
the whole config; iteration metrics use step = iteration. The final policy
adapter of each flow run becomes a version of registered model ``ppo-<run>``
(``register_policy``); ``ppo_core.registry`` loads a version back as a model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any
from unittest import mock

from ppo_core.config import PPOConfig

EXPERIMENT = "ppo"
RUN_TAG = "ppo.run"
POLICY_FILE = "policy_adapter.safetensors"  # as logged by log_iteration: the checkpoint file's own name


class RegistryError(LookupError):
    """A registered policy is missing, damaged, or does not fit the config loading it."""


def tracking_uri(cfg: PPOConfig) -> str:
    """MLFLOW_TRACKING_URI if set (a server), else an embedded SQLite store under the artifact root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(cfg.artifact_root / 'mlflow.db').resolve()}"


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
    from mlflow import MlflowClient

    cfg.artifact_root.mkdir(parents=True, exist_ok=True)
    # the registry is named explicitly too, so a process-global mlflow.set_registry_uri cannot redirect it
    return MlflowClient(tracking_uri=tracking_uri(cfg), registry_uri=registry_uri(cfg))


def _experiment_id(cfg: PPOConfig, mlf, name: str = EXPERIMENT) -> str:
    exp = mlf.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return mlf.create_experiment(name, artifact_location=(cfg.artifact_root / "mlruns").resolve().as_uri())


def _flat_params(cfg: PPOConfig) -> dict[str, str]:
    return {k: str(v) for k, v in cfg.to_json_dict().items()}


def ensure_run(cfg: PPOConfig) -> str:
    """The MLflow run id of PPO run ``cfg.run``, created on first use."""
    from mlflow.entities import Param

    mlf = client(cfg)
    exp_id = _experiment_id(cfg, mlf)
    found = mlf.search_runs([exp_id], filter_string=f"tags.`{RUN_TAG}` = '{cfg.run}'", max_results=1)
    if found:
        return found[0].info.run_id
    run = mlf.create_run(exp_id, run_name=cfg.run, tags={RUN_TAG: cfg.run})
    mlf.log_batch(run.info.run_id, params=[Param(k, v) for k, v in _flat_params(cfg).items()])
    return run.info.run_id


def log_iteration(
    cfg: PPOConfig, iteration: int, metrics: dict[str, float], step_rows: list[dict[str, Any]], iter_dir: Path
) -> None:
    """Per-iteration metrics at step=iteration; per-optimiser-step metrics at a global step."""
    from mlflow.entities import Metric

    mlf = client(cfg)
    run_id = ensure_run(cfg)
    logged = mlf.get_run(run_id).data.tags.get("last_iteration")
    if logged is not None and int(logged) >= iteration:
        return  # a resumed run re-finalising an iteration must not duplicate its steps
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, iteration) for k, v in metrics.items()]
    for row in step_rows:
        gstep = int(row["global_step"])
        batch += [Metric(f"step/{k}", float(row[k]), now, gstep) for k in ("policy_loss", "value_loss", "approx_kl", "clip_fraction")]
    for i in range(0, len(batch), 900):  # MLflow caps a batch at 1000 entities
        mlf.log_batch(run_id, metrics=batch[i : i + 900])
    mlf.set_tag(run_id, f"iter.{iteration:04d}.parquet", str(iter_dir.resolve()))
    mlf.set_tag(run_id, "last_iteration", str(iteration))
    from ppo_core.train import checkpoint_paths

    for key, path in checkpoint_paths(iter_dir / "checkpoint").items():
        if key.endswith("_adapter") and path.is_file():
            mlf.log_artifact(run_id, str(path), artifact_path=adapter_artifact_dir(iteration))
    _log_table_inputs(mlf, run_id, iter_dir, iteration)
    if (iter_dir / "eval.parquet").is_file():
        import pyarrow.parquet as pq

        samples = pq.read_table(iter_dir / "eval.parquet", columns=["prompt_id", "prompt", "response", "score"])
        mlf.log_table(run_id, data=samples.to_pandas(), artifact_file=f"samples/iter={iteration:04d}.json")


def log_report(cfg: PPOConfig, path: Path) -> None:
    """The run's HTML report as artifact ``report.html`` (replaced by each flow run); MLflow's viewer shows it."""
    client(cfg).log_artifact(ensure_run(cfg), str(path))


def adapter_artifact_dir(iteration: int) -> str:
    """Run-relative artifact folder holding an iteration's adapters."""
    return f"adapters/iter={iteration:04d}"


def _log_table_inputs(mlf, run_id: str, iter_dir: Path, iteration: int) -> None:
    """Record each experience table as an MLflow dataset input: source = its path, digest = its hash.

    The manifest already holds the content hashes, so no table is read here.
    """
    import json

    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    manifest_path = iter_dir / "manifest.json"
    if not manifest_path.is_file():
        return
    artifacts = json.loads(manifest_path.read_text())["artifacts"]
    inputs = []
    for rel, digest in sorted(artifacts.items()):
        if not rel.endswith(".parquet"):
            continue
        path = iter_dir.parent / rel
        ds = MetaDataset(source=LocalArtifactDatasetSource(str(path.resolve())), name=f"{path.stem}@iter={iteration:04d}", digest=digest[:16])
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


# ---------------------------------------------------------------- model registry


def registered_model_name(cfg: PPOConfig) -> str:
    """One registered model per PPO run, as there is one MLflow run per PPO run."""
    return f"ppo-{cfg.run}"


def policy_identity(cfg: PPOConfig) -> dict[str, str]:
    """What a policy adapter shares with every config able to load it: base weights and LoRA layout.

    The base model is named by its resolved directory, as reward-model files do:
    for SmolLM2 that name holds the GGUF's content digest and the converter version.
    """
    from ppo_core.models import resolve_model_dir
    from ppo_core.reward_model import layout

    return {"base_model_dir": resolve_model_dir(cfg.model, cfg.artifact_root).name, **layout(cfg)}


def register_policy(cfg: PPOConfig, iteration: int):
    """Register ``iteration``'s policy adapter as a version of ``ppo-<run>``; returns the ModelVersion.

    The version's source is the adapter folder logged on the PPO run
    (``runs:/<run_id>/adapters/iter=NNNN``). Idempotent: an iteration already
    registered returns its existing version, so a resumed flow adds no duplicate.
    """
    mlf = client(cfg)
    run_id = ensure_run(cfg)
    name = registered_model_name(cfg)
    _ensure_registered_model(mlf, cfg, name)
    existing = [v for v in _all_versions(mlf, name) if v.run_id == run_id and v.tags.get("iteration") == str(iteration)]
    if existing:
        return min(existing, key=lambda v: int(v.version))
    artifact_dir = _ensure_policy_logged(mlf, cfg, run_id, iteration)
    tags = {
        RUN_TAG: cfg.run,
        "iteration": str(iteration),
        "base_model": cfg.model,
        **policy_identity(cfg),
        **_provenance(cfg, iteration),
        # the hash of what the source holds, so a loader can tell a replaced artifact
        "adapter_sha256": _artifact_sha256(mlf, run_id, f"{artifact_dir}/{POLICY_FILE}"),
    }
    eval_score = _metric_at(mlf, run_id, "evaluate/eval_score", iteration)
    if eval_score is not None:
        tags["eval_score"] = repr(eval_score)
    version = mlf.create_model_version(name, f"runs:/{run_id}/{artifact_dir}", run_id=run_id, tags=tags)
    # the description names its own version number, known only once created
    return mlf.update_model_version(name, version.version, description=_how_to_load(cfg, name, version.version, tags))


def policy_version(cfg: PPOConfig, version: int | str = "latest"):
    """ModelVersion ``version`` of ``ppo-<run>``: a number, or 'latest' for the highest one."""
    mlf = client(cfg)
    name = registered_model_name(cfg)
    versions = {int(v.version): v for v in _all_versions(mlf, name)}
    if not versions:
        raise RegistryError(
            f"registered model '{name}' has no versions in {registry_uri(cfg)}: "
            f"a successful flow run of run '{cfg.run}' registers its final policy"
        )
    wanted = max(versions) if str(version).lower() == "latest" else _version_number(version)
    if wanted not in versions:
        raise RegistryError(f"registered model '{name}' has no version {wanted} (it has {sorted(versions)})")
    return versions[wanted]


def download_policy(cfg: PPOConfig, version: int | str, dst_dir: Path):
    """(ModelVersion, local adapter file) of a registered version, checked against its recorded sha256."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    from ppo_core.tables import sha256_file

    mv = policy_version(cfg, version)
    where = f"registered model '{mv.name}' version {mv.version} ({mv.source})"
    try:
        with _quiet_download():
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{mv.source}/{POLICY_FILE}", dst_path=str(dst_dir),
                tracking_uri=tracking_uri(cfg), registry_uri=registry_uri(cfg),
            )
    except (MlflowException, OSError) as exc:
        raise RegistryError(f"cannot download the policy adapter of {where}: {exc}") from exc
    recorded = mv.tags.get("adapter_sha256")
    if recorded and sha256_file(Path(local)) != recorded:
        raise RegistryError(
            f"the policy adapter of {where} is not the file registered (sha256 differs from tag "
            f"adapter_sha256 {recorded[:12]}…): the artifact was altered or replaced"
        )
    return mv, Path(local)


@contextlib.contextmanager
def _quiet_download():
    """No MLflow progress bar for the one small adapter file: it would land in `ppo generate`'s output."""
    with mock.patch.dict(os.environ, {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
        yield


def _all_versions(mlf, name: str) -> list:
    versions, token = [], None
    while True:
        page = mlf.search_model_versions(f"name = '{name}'", page_token=token)
        versions += list(page)
        token = page.token
        if not token:
            return versions


def _version_number(version: int | str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        raise RegistryError(f"model version must be a number or 'latest' (got {version!r})") from None


def _ensure_registered_model(mlf, cfg: PPOConfig, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mlf.get_registered_model(name)
        return
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    mlf.create_registered_model(
        name, tags={RUN_TAG: cfg.run},
        description=f"Policy LoRA adapters of PPO run '{cfg.run}': one version per flow run, "
        "holding the last iteration it trained.",
    )


def _ensure_policy_logged(mlf, cfg: PPOConfig, run_id: str, iteration: int) -> str:
    """The run-relative folder of the iteration's logged policy adapter, logging it now if absent.

    It is absent when the iteration was trained without tracking (``pipeline.run``),
    or when log_iteration was interrupted after marking the iteration logged.
    """
    from ppo_core.phases import checkpoint_dir
    from ppo_core.train import checkpoint_paths

    artifact_dir = adapter_artifact_dir(iteration)
    if f"{artifact_dir}/{POLICY_FILE}" in {a.path for a in mlf.list_artifacts(run_id, artifact_dir)}:
        return artifact_dir
    local = checkpoint_paths(checkpoint_dir(cfg, iteration))["policy_adapter"]
    if not local.is_file():
        raise RegistryError(
            f"iteration {iteration} of run '{cfg.run}' has no policy adapter to register: "
            f"neither the MLflow artifact {artifact_dir}/{POLICY_FILE} nor {local} exists"
        )
    mlf.log_artifact(run_id, str(local), artifact_path=artifact_dir)
    return artifact_dir


def _artifact_sha256(mlf, run_id: str, path: str) -> str:
    import tempfile

    from ppo_core.tables import sha256_file

    with tempfile.TemporaryDirectory() as tmp, _quiet_download():
        return sha256_file(Path(mlf.download_artifacts(run_id, path, tmp)))


def _provenance(cfg: PPOConfig, iteration: int) -> dict[str, str]:
    """Config hash and code version from the iteration's manifest: what produced the adapter."""
    import json

    path = cfg.iter_dir(iteration) / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    out = {"config_hash": manifest.get("config_hash", cfg.training_hash())}
    if "code_version" in manifest:
        out["code_version"] = manifest["code_version"]
    return out


def _metric_at(mlf, run_id: str, key: str, step: int) -> float | None:
    values = [m.value for m in mlf.get_metric_history(run_id, key) if m.step == step]
    return values[-1] if values else None


def _how_to_load(cfg: PPOConfig, name: str, version: int | str, tags: dict[str, str]) -> str:
    return f"""Policy LoRA adapter ({POLICY_FILE}) of PPO run '{cfg.run}' after iteration {tags['iteration']}. \
It is not a standalone model: it applies to base model `{tags['base_model']}` (directory `{tags['base_model_dir']}`) \
with LoRA on the last {tags['lora_layers']} layers, rank {tags['lora_rank']}, alpha {tags['lora_alpha']}, \
targets {tags['lora_targets']}.

Load it onto the base model and generate (Python, this project installed):

    from ppo_core import registry
    cfg = registry.run_config("{cfg.run}", artifact_root="{cfg.artifact_root.resolve()}")
    model = registry.load_registered_policy(cfg, version={version})
    print(registry.generate_text(model, ["How was your day?"]))

The files alone (this policy adapter and the value adapter of the same iteration): \
`mlflow artifacts download -u models:/{name}/{version}` with MLFLOW_TRACKING_URI={tracking_uri(cfg)}.
"""
