"""Named fail points for crash tests.

``PPO_KILL_AT=<point>[:<n>]`` makes the process SIGKILL itself the n-th time
it reaches ``<point>`` — a real kill, no exception handler or ``finally`` runs.
With ``PPO_KILL_RANK=<r>`` only data-parallel rank r (``MLX_RANK``) does.
``PPO_PAUSE_AT=<point>`` with ``PPO_PAUSE_FILE=<path>``: the first process to
reach ``<point>`` writes its pid to the file and waits there to be killed (a
test kills it by that pid); every later process finds the file and goes on.
Unset (always, outside tests) it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "PPO_KILL_AT"
_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    if os.environ.get("PPO_PAUSE_AT") == name:
        _pause_once(os.environ["PPO_PAUSE_FILE"])
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    rank = os.environ.get("PPO_KILL_RANK")
    if rank is not None and rank != os.environ.get("MLX_RANK"):
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _pause_once(path: str) -> None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:
        time.sleep(1)
