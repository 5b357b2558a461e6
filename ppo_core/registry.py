"""The model registry: each flow run's final policy as a version of ``ppo-<run>``, and back as a model.

A version of registered model ``ppo-<run>`` holds only the policy LoRA adapter
(its source is the adapter folder logged on the PPO run); it needs the same
base model and LoRA layout to mean anything, which its tags record and
``load_registered_policy`` checks before the base weights load.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ppo_core import runs, track
from ppo_core.config import PPOConfig, load_config
from ppo_core.faults import failpoint
from ppo_core.layout import Checkpoint, RunLayout
from ppo_core.models import POLICY, ModelCache, PolicyValueModel, load_policy_value_model, resolve_model_dir
from ppo_core.reward_model import lora_layout
from ppo_core.tables import sha256_file

POLICY_FILE = Checkpoint.adapter_file_name(POLICY)  # the checkpoint file's own name, as logged on the run


class RegistryError(LookupError):
    """A registered policy is missing, damaged, or does not fit the config loading it."""


@contextlib.contextmanager
def env_override(**values: str) -> Iterator[None]:
    """Set environment variables inside the block; restore the previous values (or absence) after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def registered_model_name(cfg: PPOConfig) -> str:
    """One registered model per PPO run, as there is one MLflow run per PPO run."""
    return f"ppo-{cfg.run}"


def policy_identity(cfg: PPOConfig) -> dict[str, str]:
    """What a policy adapter shares with every config able to load it: base weights and LoRA layout.

    The base model is named by its resolved directory, as reward-model files do:
    for SmolLM2 that name holds the GGUF's content digest and the converter version.
    """
    return {"base_model_dir": resolve_model_dir(cfg.model, cfg.artifact_root).name, **lora_layout(cfg)}


def register_policy(cfg: PPOConfig, iteration: int):
    """Register ``iteration``'s policy adapter as a version of ``ppo-<run>``; returns the ModelVersion.

    The version's source is the adapter folder logged on the PPO run
    (``runs:/<run_id>/`` + ``track.adapter_artifact_dir(iteration)``). Idempotent: an iteration already
    registered returns its existing version, so a resumed flow adds no duplicate.
    """
    mlf = track.client(cfg)
    run_id = track.ensure_run(cfg)
    name = registered_model_name(cfg)
    _ensure_registered_model(mlf, cfg, name)
    existing = [v for v in _all_versions(mlf, name) if v.run_id == run_id and v.tags.get("iteration") == str(iteration)]
    if existing:
        version = min(existing, key=lambda v: int(v.version))
        if version.description:
            return version
        # a process killed between creating the version and describing it: finish the job
        return mlf.update_model_version(name, version.version, description=_how_to_load(cfg, name, version.version, version.tags))
    artifact_dir = _ensure_policy_logged(mlf, cfg, run_id, iteration)
    tags = {
        track.RUN_TAG: cfg.run,
        "iteration": str(iteration),
        "base_model": cfg.model,
        **policy_identity(cfg),
        **_provenance(cfg, iteration),
    }
    uploaded = _artifact_sha256(mlf, run_id, f"{artifact_dir}/{POLICY_FILE}")
    # the hash the iteration's manifest recorded for its checkpoint (what training wrote), where the run's
    # files are at hand; from a machine with only the tracking server, the logged artifact's
    tags["adapter_sha256"] = _manifest_sha256(cfg, iteration) if cfg.layout.manifest(iteration).is_file() else uploaded
    if uploaded != tags["adapter_sha256"]:
        raise RegistryError(
            f"the policy adapter logged for iteration {iteration} of run '{cfg.run}' (sha256 {uploaded[:12]}…) is not "
            f"the checkpoint its manifest recorded ({tags['adapter_sha256'][:12]}…): refusing to register it"
        )
    eval_score = _metric_at(mlf, run_id, "evaluate/eval_score", iteration)
    if eval_score is not None:
        tags["eval_score"] = repr(eval_score)
    version = mlf.create_model_version(name, f"runs:/{run_id}/{artifact_dir}", run_id=run_id, tags=tags)
    failpoint("registry.version_created")
    # the description names its own version number, known only once created
    return mlf.update_model_version(name, version.version, description=_how_to_load(cfg, name, version.version, tags))


def policy_version(cfg: PPOConfig, version: int | str = "latest"):
    """ModelVersion ``version`` of ``ppo-<run>``: a number, or 'latest' for the highest one."""
    mlf = track.client(cfg)
    name = registered_model_name(cfg)
    versions = {int(v.version): v for v in _all_versions(mlf, name)}
    if not versions:
        raise RegistryError(
            f"registered model '{name}' has no versions in {track.shareable_uri(track.registry_uri(cfg))}: "
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

    mv = policy_version(cfg, version)
    where = f"registered model '{mv.name}' version {mv.version} ({mv.source})"
    try:
        with _quiet_download():
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{mv.source}/{POLICY_FILE}", dst_path=str(dst_dir),
                tracking_uri=track.tracking_uri(cfg), registry_uri=track.registry_uri(cfg),
            )
    except (MlflowException, OSError) as exc:
        raise RegistryError(f"cannot download the policy adapter of {where}: {exc}") from exc
    recorded = mv.tags.get("adapter_sha256")
    if not recorded:
        raise RegistryError(f"{where} has no adapter_sha256 tag: it cannot be checked, so it is not loaded")
    if sha256_file(Path(local)) != recorded:
        raise RegistryError(
            f"the policy adapter of {where} is not the file registered (sha256 differs from tag "
            f"adapter_sha256 {recorded[:12]}…): the artifact was altered or replaced"
        )
    return mv, Path(local)


@contextlib.contextmanager
def _quiet_download():
    """No MLflow progress bar for the one small adapter file: it would land in `ppo generate`'s output."""
    with env_override(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"):
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
        name, tags={track.RUN_TAG: cfg.run},
        description=f"Policy LoRA adapters of PPO run '{cfg.run}': one version per flow run, "
        "holding the last iteration it trained.",
    )


def _ensure_policy_logged(mlf, cfg: PPOConfig, run_id: str, iteration: int) -> str:
    """The run-relative folder of the iteration's logged policy adapter, logging it now if absent.

    It is absent when the iteration was trained without tracking (``pipeline.run``),
    or when log_iteration was interrupted after marking the iteration logged.
    """
    artifact_dir = track.adapter_artifact_dir(iteration)
    if f"{artifact_dir}/{POLICY_FILE}" in {a.path for a in mlf.list_artifacts(run_id, artifact_dir)}:
        return artifact_dir
    local = cfg.layout.checkpoint(iteration).adapter(POLICY)
    if not local.is_file():
        raise RegistryError(
            f"iteration {iteration} of run '{cfg.run}' has no policy adapter to register: "
            f"neither the MLflow artifact {artifact_dir}/{POLICY_FILE} nor {local} exists"
        )
    mlf.log_artifact(run_id, str(local), artifact_path=artifact_dir)
    return artifact_dir


def _manifest_sha256(cfg: PPOConfig, iteration: int) -> str:
    """The policy adapter's sha256 as iteration ``iteration``'s manifest recorded it."""
    path = cfg.layout.manifest(iteration)
    rel = str(cfg.layout.checkpoint(iteration).adapter(POLICY).resolve().relative_to(cfg.layout.run_dir.resolve()))
    try:
        return json.loads(path.read_text())["artifacts"][rel]
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        raise RegistryError(f"iteration {iteration} of run '{cfg.run}' has no manifest entry for {rel} ({path}): {exc}") from None


def _artifact_sha256(mlf, run_id: str, path: str) -> str:
    with tempfile.TemporaryDirectory() as tmp, _quiet_download():
        return sha256_file(Path(mlf.download_artifacts(run_id, path, tmp)))


def _provenance(cfg: PPOConfig, iteration: int) -> dict[str, str]:
    """Config hash and code version from the iteration's manifest: what produced the adapter."""
    path = cfg.layout.manifest(iteration)
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
`mlflow artifacts download -u models:/{name}/{version}` with MLFLOW_TRACKING_URI={track.shareable_uri(track.tracking_uri(cfg))}.
"""


def run_config(run: str, artifact_root: Path | str | None = None, overrides: dict[str, Any] | None = None) -> PPOConfig:
    """The config run ``run`` was trained with (pinned in its ``RunLayout.run_json``), read from ``artifact_root``.

    A run's LoRA layout and base model are fixed when it starts, so its own
    config is the one that loads its registered adapters. Without that file
    (another machine sharing the tracking server) the defaults plus
    ``overrides`` are used, and a mismatch is reported on load.
    """
    root = Path(artifact_root) if artifact_root is not None else PPOConfig.model_fields["artifact_root"].default
    pinned_path = RunLayout(root, run).run_json
    pinned = runs.read_json(pinned_path, "the run's pinned config", runs.PINNED_KEYS)["config"] if pinned_path.is_file() else {}
    # the pinned artifact_root may be stale (a moved folder); the one given here is where the run is now
    return load_config(overrides={**pinned, **(overrides or {}), "run": run, "artifact_root": str(root)})


def check_compatible(cfg: PPOConfig, version) -> None:
    """Refuse a registered version whose base model or LoRA layout differs from ``cfg``'s, naming each difference."""
    expected = policy_identity(cfg)
    wrong = {k: (version.tags.get(k), v) for k, v in expected.items() if version.tags.get(k) != v}
    if wrong:
        raise RegistryError(
            f"registered model '{version.name}' version {version.version} does not fit this config: "
            + ", ".join(f"{k} {got!r} (config: {want!r})" for k, (got, want) in sorted(wrong.items()))
            + f"; load it with the config of run '{version.tags.get(track.RUN_TAG)}' "
            "(ppo_core.registry.run_config)"
        )


def load_registered_policy(
    cfg: PPOConfig, version: int | str = "latest", cache: ModelCache | None = None
) -> PolicyValueModel:
    """The base model of ``cfg`` with the policy adapter of registered version ``version`` loaded.

    Generate with ``generate_text`` or ``ppo_core.generate.generate(model, ..., adapter="policy")``.
    The model comes from ``cache``; without one it is a model of the caller's
    own, so no phase run later in the process can replace its adapter.
    """
    with tempfile.TemporaryDirectory(prefix="ppo-policy-") as tmp:
        mv, adapter_file = download_policy(cfg, version, Path(tmp))
        check_compatible(cfg, mv)  # before the base weights load
        model = load_policy_value_model(cfg, cache if cache is not None else ModelCache())
        model.load_adapter(POLICY, adapter_file)
    return model


def generate_text(
    model: PolicyValueModel, prompts: list[str], *, max_new_tokens: int = 40, temperature: float = 0.0, seed: int = 0
) -> list[str]:
    """The policy's answers to ``prompts`` (each a user turn); ``temperature`` 0 is greedy."""
    from ppo_core.generate import decode_responses, generate, render_prompts, row_seeds

    gen = generate(
        model, render_prompts(model, prompts), adapter=POLICY,
        max_new_tokens=max_new_tokens, temperature=temperature, seeds=row_seeds(str(seed), range(len(prompts))),
    )
    return decode_responses(model, gen.response_ids)
