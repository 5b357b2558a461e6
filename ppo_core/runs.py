"""Run-level bookkeeping: the run's pinned config, its lock, iteration numbering, manifests."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import polars as pl

from ppo_core.config import ConfigError, PPOConfig
from ppo_core.faults import failpoint
from ppo_core.layout import RunLayout
from ppo_core.prompts import load_prompts
from ppo_core.tables import atomic_write_text, sha256_file

_CODE_DIR = Path(__file__).resolve().parent


def code_version() -> str:
    """Hash of the library's source: recorded in every manifest."""
    h = hashlib.sha256()
    for p in sorted(_CODE_DIR.glob("*.py")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def check_inputs(cfg: PPOConfig, create_root: bool = True) -> None:
    """Everything that can be checked before a model loads: prompt files, batch size, writability.

    Without ``create_root`` nothing is written: the artifact root, if missing,
    must be creatable in its nearest existing parent folder.
    """
    prompts = load_prompts(cfg.prompts_path)
    if cfg.batch_size > prompts.height:
        raise ConfigError(
            f"config field 'batch_size': {cfg.batch_size} is larger than the prompt set "
            f"({prompts.height} prompts in {cfg.prompts_path})"
        )
    loaded = [prompts] + ([load_prompts(cfg.eval_prompts_path)] if cfg.eval_size else [])
    from ppo_core.memory import check_memory

    check_memory(cfg, loaded)  # before any model loads: a config too large for this machine is refused, fields named
    check_prompts_fit(cfg, *loaded)
    if cfg.reward_model_file is not None and not cfg.reward_model_file.is_file():
        raise ConfigError(f"config field 'reward': reward model file {cfg.reward_model_file} does not exist")
    if cfg.reward.startswith("python:"):
        from ppo_core.user_reward import UserRewardError, load_user_reward

        try:  # import it now: a typo in the user's module fails before any model loads
            load_user_reward(cfg.reward)
        except UserRewardError as exc:
            raise ConfigError(str(exc)) from None
    root = cfg.artifact_root
    if create_root:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"artifact root {root} cannot be created: {exc.strerror}") from None
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"artifact root {root} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"artifact root {root} is not writable" + (f" ({existing} is not)" if existing != root else ""))


def check_prompts_fit(cfg: PPOConfig, prompts: pl.DataFrame, eval_prompts: pl.DataFrame | None = None) -> None:
    """Refuse a prompt too long for the model's context now, with the model's tokenizer alone: no weights load.

    The rollout (or evaluate) phase finds such a prompt too, but only after
    the run's config was pinned: a run that trained nothing, whose config can
    no longer change (say, a lower max_new_tokens). Writes nothing. The
    default model is checked once converted (its first run converts it); a
    tokenizer or config.json that does not load is left to the model load,
    which names the model directory.
    """
    from types import SimpleNamespace

    from ppo_core.config import DEFAULT_MODEL
    from ppo_core.models import smollm2_converted_dir
    from ppo_core.prompts import check_prompt_lengths, context_length

    model_dir = smollm2_converted_dir(cfg.artifact_root) if cfg.model == DEFAULT_MODEL else Path(cfg.model).expanduser()
    if not (model_dir / "config.json").is_file():
        return
    sets = [(cfg.prompts_path, prompts, cfg.max_new_tokens)]
    if eval_prompts is not None:
        sets.append((cfg.eval_prompts_path, eval_prompts.head(cfg.eval_size), cfg.eval_max_new_tokens))
    from mlx_lm.utils import load_tokenizer
    from transformers.utils import logging as transformers_logging

    from ppo_core.generate import render_prompts

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # not its "longer than the maximum" warning: the refusal says it
    try:
        model = SimpleNamespace(tokenizer=load_tokenizer(model_dir))  # what render_prompts reads of a model
        context = context_length(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings"),
                                 model.tokenizer)
        counts = [[len(ids) for ids in render_prompts(model, prompts["prompt"].to_list())] for _, prompts, _ in sets]
    except Exception:  # noqa: BLE001  (a broken tokenizer or config: the model load reports it by name)
        return
    finally:
        transformers_logging.set_verbosity(verbosity)
    for (path, prompts, max_new_tokens), n_tokens in zip(sets, counts):
        check_prompt_lengths(prompts, n_tokens, max_new_tokens, context, path)


def check_visible(cfg: PPOConfig) -> None:
    """Fail clearly on a node that does not see the run's artifact root (on a cluster: the shared filesystem)."""
    if not cfg.layout.run_json.is_file():
        raise ConfigError(
            f"node {socket.gethostname()} does not see artifact root {cfg.artifact_root} (no {cfg.layout.run_json}): "
            "every node of the cluster must mount the shared artifact root at the same path"
        )


class ArtifactIntegrityError(RuntimeError):
    """A run's bookkeeping file is damaged, or a finished artifact differs from its manifest even after recomputing."""


def read_json(path: Path, what: str, required: tuple[str, ...] = ()) -> Any:
    """A run's JSON file (run.json, a manifest), or an error naming it when it is damaged.

    ``required``: the keys it must hold (a flipped bit in a key's name leaves valid JSON without it).
    """
    try:
        payload = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactIntegrityError(f"{what} {path} is damaged ({exc}); restore it or start a new run name") from None
    missing = [k for k in required if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ArtifactIntegrityError(
            f"{what} {path} is damaged (no {', '.join(map(repr, missing))}); restore it or start a new run name"
        )
    return payload


PINNED_KEYS = ("run", "training_hash", "config")  # what run.json must hold
MANIFEST_KEYS = ("artifacts", "phases", "config_hash")


def pinned_files(cfg: PPOConfig) -> dict[str, Path]:
    """Files a run's config names by path whose content must not change mid-run: the reward's and the base model's."""
    from ppo_core.config import DEFAULT_MODEL

    files: dict[str, Path] = {}
    if cfg.model != DEFAULT_MODEL:  # SmolLM2 is pinned by the digest in its converted folder's name
        for p in sorted(Path(cfg.model).expanduser().glob("model*.safetensors")):
            files[f"base model {p.name}"] = p
    if cfg.reward_model_file is not None:
        files["reward model"] = cfg.reward_model_file
    if cfg.reward_source_file is not None:
        files["reward code"] = cfg.reward_source_file
    return files


def pin_config(cfg: PPOConfig) -> None:
    """Record the run's config, and the sha256 of its ``pinned_files``, on first use; refuse a change later.

    A run's tables must never mix two configs: change a knob, start a new run.
    The reward's and base model's paths are in the config but not their bytes:
    retraining a reward model in place would otherwise change a run's reward
    mid-run, silently.
    """
    path = cfg.layout.run_json
    now = check_pinned(cfg)
    if not path.is_file():
        payload = {"run": cfg.run, "training_hash": cfg.training_hash(), "config": cfg.to_json_dict(), "pinned_sha256": now}
        atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True))
        return
    payload = read_json(path, "the run's pinned config", PINNED_KEYS)
    if payload.get("pinned_sha256") is None:  # a run started before files were pinned: pin them now
        atomic_write_text(path, json.dumps({**payload, "pinned_sha256": now}, indent=2, sort_keys=True))


def check_pinned(cfg: PPOConfig) -> dict[str, str]:
    """Refuse a config or pinned file that differs from what run ``cfg.run`` started with (writes nothing).

    Returns the sha256 of the config's ``pinned_files`` as they are now.
    """
    path = cfg.layout.run_json
    files = pinned_files(cfg)
    now = {name: sha256_file(p) for name, p in files.items() if p.is_file()}
    if not path.is_file():
        return now
    payload = read_json(path, "the run's pinned config", PINNED_KEYS)
    if payload["training_hash"] != cfg.training_hash():
        old, new = payload["config"], cfg.to_json_dict()
        fields = PPOConfig.model_fields
        diff = sorted(k for k in new if k not in ("run", "artifact_root") and old.get(k, fields[k].default) != new[k])
        raise ConfigError(
            f"run '{cfg.run}' was started with a different config (changed: "
            + ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in diff)
            + "); use a new run name to train with it"
        )
    pinned = payload.get("pinned_sha256")
    if pinned is None:
        return now
    changed = sorted(name for name in set(pinned) | set(now) if pinned.get(name) != now.get(name))
    if changed:
        raise ConfigError(
            f"run '{cfg.run}' was started with other contents of: "
            + "; ".join(f"{name} {files.get(name, '?')} (sha256 {str(pinned.get(name))[:12]}… then, "
                        f"{str(now.get(name))[:12]}… now)" for name in changed)
            + "; a run's reward and base model must not change mid-run: restore them or start a new run name"
        )
    return now


def damaged_artifacts(cfg: PPOConfig, iteration: int) -> list[str]:
    """Files of finished ``iteration`` (tables, checkpoint, metrics) missing or different from its manifest."""
    if not cfg.layout.manifest(iteration).is_file():
        return []  # an unfinished iteration: its phases verify their own outputs
    recorded = read_manifest(cfg, iteration)["artifacts"]
    run_dir = cfg.layout.run_dir.resolve()
    return [rel for rel, digest in sorted(recorded.items())
            if not (run_dir / rel).is_file() or sha256_file(run_dir / rel) != digest]


class RunBusyError(RuntimeError):
    """Another process is training the same run."""


def lock_holder(layout: RunLayout) -> str | None:
    """Who holds the run's lock now ("pid N on host H"), or None when nobody trains it."""
    path = layout.lock
    if not path.is_file():
        return None
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fh)
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def _holder(lock_file) -> str:
    """What the holder of a lock file wrote in it: who it is (its first line)."""
    lock_file.seek(0)
    first = lock_file.readline().strip()
    # a holder that has just taken the lock may not have written its name over its predecessor's yet
    return first if first and not first.startswith(RELEASED) else "another process"


def _busy(cfg: PPOConfig, holder: str) -> RunBusyError:
    return RunBusyError(f"run '{cfg.run}' is being trained by {holder}; wait for it to finish")


def preflight(cfg: PPOConfig) -> None:
    """Every check of a training run that needs neither a model nor a server, writing nothing.

    ``ppo train`` runs it before a Prefect flow run starts; the flow repeats
    the checks (a deployment run has no such command in front of it).
    """
    from ppo_core.models import check_model_available

    check_inputs(cfg, create_root=False)
    check_model_available(cfg.model)
    check_pinned(cfg)
    holder = lock_holder(cfg.layout)
    if holder is not None:
        raise _busy(cfg, holder)


RELEASED = "released"  # how the line a holder leaves on exit starts: "released (completed): pid N on host H, …"
CARRIED_MAX = 20  # earlier holders' unrecorded lines kept in the lock, newest first
_RELEASED_LINE = re.compile(rf"{RELEASED} \((completed|failed: (.*))\): (.*)$")


def parse_holder_line(line: str) -> tuple[str, str | None]:
    """(holder, outcome) of a lock file line: outcome ``completed``, ``failed: <why>``, or None for a holder that
    died holding the lock (its bare name). The holder part names its flow run, if any; a failure's text may not."""
    released = _RELEASED_LINE.match(line)
    return (released.group(3), released.group(1)) if released else (line, None)


@contextlib.contextmanager
def run_lock(cfg: PPOConfig, owner: str | None = None) -> Iterator[list[str]]:
    """Exclusive lock on a run: two processes never interleave one run's iterations.

    The lock file's first line names its holder (and ``owner``, e.g. a Prefect
    flow run) while held; on exit the holder leaves ``released (completed):
    <holder>`` or ``released (failed: <why>): <holder>`` there. Below it stay
    the lines of earlier holders that named a flow run whose end no
    orchestrator has recorded yet: a holder that died holding the lock (its
    bare name), or one that finished while the orchestrator was away. The block
    receives those lines, newest first, and removes each one it records; the
    others are handed on to the next holder.
    """
    path = cfg.layout.lock
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fh)
        fh.close()
        raise _busy(cfg, holder) from None
    fh.seek(0)
    earlier = [line for line in fh.read().splitlines() if "flow run " in line][:CARRIED_MAX]
    # on a shared filesystem the holder may be on another machine: name it
    me = f"pid {os.getpid()} on host {socket.gethostname()}" + (f", {owner}" if owner else "")
    _rewrite(fh, "\n".join([me, *earlier]))
    outcome = "completed"
    try:
        yield earlier
    except BaseException as exc:
        outcome = "failed: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise
    finally:
        _rewrite(fh, "\n".join([f"{RELEASED} ({outcome}): {me}", *earlier][: CARRIED_MAX + 1]))
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def _rewrite(lock_file, text: str) -> None:
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(text)
    lock_file.flush()


TEMP_FILE_GLOB = ".*.tmp*"  # tables.atomic_path's temporary names: .<stem>.<random>.tmp<suffix>


def remove_stale_temp_files(cfg: PPOConfig) -> list[Path]:
    """Delete the temporary files a killed process left in the run's folder; call it holding the run's lock.

    Every writer of a run's files runs under its lock (shards too, inside the
    flow run that holds it), so with the lock held no temporary file is live.
    """
    stale = [p for p in cfg.layout.run_dir.rglob(TEMP_FILE_GLOB) if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def next_iteration(cfg: PPOConfig) -> int:
    done = cfg.layout.completed_iterations()
    return (done[-1] + 1) if done else 1


def write_manifest(cfg: PPOConfig, iteration: int, phase_results: list[dict[str, Any]]) -> Path:
    """The iteration's manifest: content hash of every artifact, config hash, code version."""
    artifacts = {}
    for r in phase_results:
        for name, p in r["outputs"].items():
            rel = Path(p).resolve().relative_to(cfg.layout.run_dir.resolve())
            artifacts[str(rel)] = sha256_file(Path(p))
    manifest = {
        "run": cfg.run,
        "iteration": iteration,
        "config_hash": cfg.training_hash(),
        "code_version": code_version(),
        "artifacts": artifacts,
        "phases": {r["phase"]: {"cached": r["cached"], "seconds": r["seconds"], "stats": r["stats"]} for r in phase_results},
        # when the iteration finished: the timestamp of its MLflow metrics, however often they are logged
        "finished_at_ms": int(time.time() * 1000),
    }
    path = cfg.layout.manifest(iteration)
    if path.is_file():
        old = read_json(path, f"the manifest of iteration {iteration}")
        if old.get("artifacts") == artifacts and old.get("config_hash") == manifest["config_hash"]:
            return path  # a resumed iteration keeps the manifest that first described these bytes
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True))
    failpoint("manifest.done")
    return path


def read_manifest(cfg: PPOConfig, iteration: int) -> dict[str, Any]:
    return read_json(cfg.layout.manifest(iteration), f"the manifest of iteration {iteration}", MANIFEST_KEYS)


def finished_at_ms(cfg: PPOConfig, manifest: dict[str, Any], iteration: int) -> int:
    """When ``iteration`` finished (a manifest written before the field existed: its file's time)."""
    recorded = manifest.get("finished_at_ms")
    return int(recorded) if recorded is not None else int(cfg.layout.manifest(iteration).stat().st_mtime * 1000)


def step_rows(cfg: PPOConfig, iteration: int) -> list[dict[str, Any]]:
    """The iteration's optimiser-step metrics, numbered by a step count global to the run."""
    path = cfg.layout.table(iteration, "metrics")
    if not path.is_file():
        return []
    df = pl.read_parquet(path)
    return df.with_columns(global_step=(iteration - 1) * cfg.steps_per_iteration + pl.col("step")).to_dicts()
