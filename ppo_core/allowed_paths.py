"""Which files a deployment's parameters may name: only those under the worker's allowed roots.

Whoever can start a deployment run chooses its parameters, and a path there is
read (prompts land in tables, the report and MLflow) or written (the artifact
root) or run (a ``python:`` reward) as the worker's user. So a deployment run
refuses every path parameter that does not resolve, symlinks followed, inside
one of ``PPO_ALLOWED_ROOTS`` (``os.pathsep``-separated; default: the project's
``artifacts``, ``data`` and ``examples`` folders). A run started from the
command line on one's own machine is not checked: its user can read those
files anyway.
"""

from __future__ import annotations

import os
from pathlib import Path

from ppo_core.config import DEFAULT_MODEL, PROJECT_ROOT, ConfigError, PPOConfig
from ppo_core.user_reward import parse_spec

ROOTS_ENV = "PPO_ALLOWED_ROOTS"
DEFAULT_ROOTS = (PROJECT_ROOT / "artifacts", PROJECT_ROOT / "data", PROJECT_ROOT / "examples")


def allowed_roots() -> list[Path]:
    raw = os.environ.get(ROOTS_ENV)
    roots = [Path(p) for p in raw.split(os.pathsep) if p] if raw else list(DEFAULT_ROOTS)
    return [r.expanduser().resolve() for r in roots]


def _inside(path: Path, roots: list[Path]) -> bool:
    resolved = Path(path).expanduser().resolve()
    return any(resolved == r or resolved.is_relative_to(r) for r in roots)


def path_parameters(cfg: PPOConfig, config_file: str | Path | None) -> dict[str, Path]:
    """Every file or folder the run would read, write or execute, by the parameter that names it."""
    named: dict[str, Path] = {
        "artifact_root": cfg.artifact_root,
        "prompts_path": cfg.prompts_path,
        "eval_prompts_path": cfg.eval_prompts_path,
    }
    if config_file is not None:
        named["config"] = Path(config_file)
    if cfg.model != DEFAULT_MODEL:
        named["model"] = Path(cfg.model)
    if cfg.reward_model_file is not None:
        named["reward"] = cfg.reward_model_file
    elif cfg.reward.startswith("python:"):
        named["reward"] = cfg.reward_source_file  # a module too: its file must lie inside a root
    return named


def _refuse(outside: dict[str, Path], roots: list[Path]) -> None:
    if outside:
        raise ConfigError(
            "deployment parameter(s) outside the worker's allowed roots: "
            + "; ".join(f"'{name}' = {p}" for name, p in outside.items())
            + f" (allowed: {', '.join(str(r) for r in roots)}; the worker's {ROOTS_ENV} sets them)"
        )


def check_config_file(config_file: str | Path | None) -> None:
    """Before the file is opened: a config file outside the roots is never read (not even to say it is missing)."""
    if config_file is not None:
        roots = allowed_roots()
        _refuse({} if _inside(Path(config_file), roots) else {"config": Path(config_file)}, roots)


def check_allowed_paths(cfg: PPOConfig, config_file: str | Path | None = None) -> PPOConfig:
    """Refuse, naming the parameter, any path outside the allowed roots; return ``cfg`` with those paths resolved.

    The run then uses the absolute, symlink-free paths that were checked, in
    this process and in every worker and rank it hands the config to.
    """
    if cfg.reward.startswith("python:") and not parse_spec(cfg.reward)[0].endswith(".py"):
        # finding a module imports its parent packages: code would run before any check could refuse it
        raise ConfigError("deployment parameter 'reward': a deployment takes python: rewards as files "
                          "(python:<path/to/file.py>:<function>) under the allowed roots, not modules")
    roots = allowed_roots()
    named = path_parameters(cfg, config_file)
    _refuse({name: p for name, p in named.items() if not _inside(p, roots)}, roots)
    resolved = {k: Path(v).expanduser().resolve() for k, v in named.items() if k in ("artifact_root", "prompts_path", "eval_prompts_path")}
    if "model" in named:
        resolved["model"] = str(Path(cfg.model).expanduser().resolve())
    if cfg.reward_model_file is not None:
        resolved["reward"] = f"model:{cfg.reward_model_file.expanduser().resolve()}"
    return cfg.model_copy(update=resolved)
