"""Progress of a long phase: done / total, rate and ETA, logged every few seconds while it runs.

A phase opens ``report(...)`` around its long loop and the loop calls
``advance(n)``; the line goes to logger ``ppo_core.progress``, which Prefect
attaches to its console and API handlers (``PREFECT_LOGGING_EXTRA_LOGGERS``),
so it shows in the terminal and in the task run's logs in the Prefect UI.
Code that runs with no report open (a test, a notebook) advances nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

LOG = logging.getLogger(__name__)  # ppo_core.progress
LOG.setLevel(logging.INFO)  # shown wherever a handler listens (Prefect's console and API), whatever the root's level
EVERY_SECONDS = 5.0


@dataclass
class Reporter:
    what: str
    total: float  # an upper bound where the work may end early (sampling stops at EOS)
    unit: str
    started: float = field(default_factory=lambda: time.monotonic())
    done: float = 0.0
    last: float = field(default_factory=lambda: time.monotonic())

    def advance(self, n: float) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= EVERY_SECONDS:
            self.last = now
            LOG.info(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        left = max(self.total - self.done, 0.0)
        eta = f"ETA {left / rate:.0f} s" if rate > 0 else "ETA ?"
        share = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.what}: {self.done:,.0f}/{self.total:,.0f} {self.unit} ({share:.0f}%), {rate:,.1f} {self.unit}/s, {eta}"


_CURRENT: ContextVar[Reporter | None] = ContextVar("ppo_progress", default=None)


@contextlib.contextmanager
def report(what: str, total: float, unit: str) -> Iterator[Reporter]:
    """Report the progress of ``what`` (``total`` ``unit``s) inside the block."""
    token = _CURRENT.set(Reporter(what, float(total), unit))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def advance(n: float = 1) -> None:
    """``n`` more units of the open report's work are done (nothing without one)."""
    reporter = _CURRENT.get()
    if reporter is not None:
        reporter.advance(n)
