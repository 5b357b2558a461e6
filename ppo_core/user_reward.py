"""The user's own reward function: ``reward=python:<module>:<function>`` or ``python:<file.py>:<function>``.

The contract (see README, "Your own reward"):

    def my_reward(prompts: list[str], responses: list[str]) -> Sequence[float]

is called once per batch with every prompt and its response (the response's
text as the user reads it: decoded, without the end-of-sequence token) and
returns one finite float per response, higher is better. It is scored like the
built-in rewards: an exception, a wrong length or a non-finite score fails the
phase with a message naming the function, and nothing already written is lost.

The function's source file is an input of every phase that scores, so editing
it makes the next run recompute rewards instead of reusing stale ones; it is
(re)loaded every time a phase builds the reward, so a long-lived worker runs the
code the cache key hashed. Only that file is hashed: bump it when a module or
data file it reads changes.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

PREFIX = "python:"
_SPEC = re.compile(r"^python:(?P<target>.+):(?P<function>[A-Za-z_]\w*)$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class UserRewardError(RuntimeError):
    """The user's reward function cannot be found or loaded."""


def parse_spec(spec: str) -> tuple[str, str]:
    """'python:<target>:<function>' -> (target, function); target is a dotted module or a .py file."""
    m = _SPEC.match(spec)
    if not m or not (m["target"].endswith(".py") or _MODULE.match(m["target"])):
        raise ValueError(
            f"{spec!r} is not a Python reward: write python:<module>:<function> (a module importable from "
            "PYTHONPATH) or python:<path/to/file.py>:<function>"
        )
    return m["target"], m["function"]


def normalize_spec(spec: str) -> str:
    """A file target made absolute, so the spec means the same file in every process (workers, ranks)."""
    target, function = parse_spec(spec)
    if target.endswith(".py"):
        target = str(Path(target).expanduser().resolve())
    return f"{PREFIX}{target}:{function}"


def source_file(spec: str) -> Path:
    """The file that defines the reward: its bytes belong in the cache key of every scoring phase."""
    target, _ = parse_spec(spec)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserRewardError(f"config field 'reward': reward file {path} does not exist")
        return path.resolve()
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as exc:
        raise UserRewardError(f"config field 'reward': cannot find module '{target}': {exc}") from None
    if found is None or not found.origin or not Path(found.origin).is_file():
        raise UserRewardError(
            f"config field 'reward': module '{target}' is not importable (is its folder on PYTHONPATH?)"
        )
    return Path(found.origin).resolve()


def _module(target: str) -> Any:
    if not target.endswith(".py"):
        fresh = target not in sys.modules
        module = importlib.import_module(target)
        return module if fresh else importlib.reload(module)  # the bytes the cache key hashed, not a stale copy
    path = source_file(f"{PREFIX}{target}:f")
    name = "ppo_user_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class UserReward:
    """The user's function behind the built-in rewards' interface."""

    fn: Callable[[list[str], list[str]], Any]
    name: str

    def __call__(self, prompts: list[str], responses: list[str], n_tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self.fn(list(prompts), list(responses)), dtype=np.float64)


def load_user_reward(spec: str) -> UserReward:
    """Import the module (or run the file) and take the named function from it."""
    target, function = parse_spec(spec)
    source_file(spec)  # a clear error before the import machinery's own
    try:
        module = _module(target)
    except Exception as exc:
        raise UserRewardError(f"config field 'reward': importing '{target}' raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        raise UserRewardError(f"config field 'reward': '{target}' has no function '{function}'")
    return UserReward(fn, f"{Path(target).name if target.endswith('.py') else target}:{function}")
