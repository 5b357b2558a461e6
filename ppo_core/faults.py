"""Named fail points for crash tests.

Every fail point has a label that does not depend on what the process did
before it: ``<scope>/<point>[:<detail>]#<n>``, e.g.
``iter=0001/rollout/generate.step#3`` (the third sampling step of iteration
1's rollout) or ``iter=0002/mlflow/mlflow.metrics#1``. The scope is set by
``scope()`` around a unit of work (a phase, an iteration's MLflow logging, the
registration), and the counts restart when it is entered, so a resumed process
reaches the same labels for the work it still has to do.

- ``PPO_FAULT_TRACE=<file>`` appends every label reached to the file.
- ``PPO_KILL_AT=<label>[,<label>…]`` SIGKILLs the process at the first listed
  label it reaches (after tracing it): a real kill, no handler or ``finally``
  runs. The older form ``<point>[:<n>]`` kills at the n-th time a point is
  reached in the process, whatever its scope; with ``PPO_KILL_RANK=<r>`` only
  data-parallel rank r (``MLX_RANK``) does. ``PPO_KILL_GROUP=1`` kills the
  process's whole process group instead (what a machine or container dying does).
- ``PPO_PAUSE_AT=<point or label>[,…]`` with ``PPO_PAUSE_FILE=<path>`` (the
  second listed point uses ``<path>.1``, and so on): the first
  process to reach it writes its pid to the file and waits there until it is
  killed or the file's text is replaced by ``release``; every later process
  finds the file and goes on.

Unset (always, outside tests) a fail point costs a few dict lookups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator

ENV = "PPO_KILL_AT"
TRACE_ENV = "PPO_FAULT_TRACE"
_hits: dict[str, int] = {}  # by point name, for the older PPO_KILL_AT form
_scope = "run"
_scope_hits: dict[str, int] = {}  # by label, since the scope was entered


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Label the fail points reached inside the block with ``name``; their counts restart here."""
    global _scope, _scope_hits
    saved = _scope, _scope_hits
    _scope, _scope_hits = name, {}
    try:
        yield
    finally:
        _scope, _scope_hits = saved


def failpoint(name: str, detail: str = "") -> None:
    if not (os.environ.get(ENV) or os.environ.get(TRACE_ENV) or os.environ.get("PPO_PAUSE_AT")):
        return
    base = f"{_scope}/{name}" + (f":{detail}" if detail else "")
    _scope_hits[base] = _scope_hits.get(base, 0) + 1
    label = f"{base}#{_scope_hits[base]}"
    if trace := os.environ.get(TRACE_ENV):
        with open(trace, "a") as fh:  # line-sized appends: a kill right after leaves the line whole
            fh.write(label + "\n")
    if pause := os.environ.get("PPO_PAUSE_AT"):
        points = pause.split(",")
        for i, point in enumerate(points):
            if point in (name, label):  # the i-th listed point pauses on its own file: PPO_PAUSE_FILE, then .1, .2, …
                _pause_once(os.environ["PPO_PAUSE_FILE"] + (f".{i}" if i else ""))
    spec = os.environ.get(ENV)
    if not spec:
        return
    if "#" in spec:
        if label in spec.split(","):
            _kill()
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    rank = os.environ.get("PPO_KILL_RANK")
    if rank is not None and rank != os.environ.get("MLX_RANK"):
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(count or 1):
        _kill()


def _kill() -> None:
    if os.environ.get("PPO_KILL_GROUP") == "1":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _pause_once(path: str) -> None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:  # until killed, or released by a test that wants it to go on
        time.sleep(0.2)
        with contextlib.suppress(OSError), open(path) as fh:
            if fh.read().strip() == "release":
                return
