"""Named fail points for crash tests.

``PPO_KILL_AT=<point>[:<n>]`` makes the process SIGKILL itself the n-th time
it reaches ``<point>`` — a real kill, no exception handler or ``finally`` runs.
Unset (always, outside tests) it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "PPO_KILL_AT"
_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
