"""Phase records: reuse a phase's outputs when its inputs, config and code are unchanged.

A phase's cache key hashes its name and code version, the config's training
hash, the iteration and the content of every input file. Its record (where
``RunLayout.phase_record`` puts it) holds that key, the output paths and their
hashes: a record whose key matches and whose outputs still hash the same is a
finished phase; anything else is recomputed, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ppo_core.config import PPOConfig
from ppo_core.faults import failpoint, scope
from ppo_core.layout import iter_label
from ppo_core.tables import atomic_write_text, sha256_file

Compute = Callable[[], tuple[dict[str, Path], dict[str, float]]]


@dataclass
class PhaseResult:
    """JSON-serialisable outcome of a phase (what a Prefect task returns)."""

    phase: str
    iteration: int
    outputs: dict[str, str]
    hashes: dict[str, str]
    cached: bool
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return Path(self.outputs[name])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cache_key(cfg: PPOConfig, iteration: int, phase: str, version: int, inputs: dict[str, Path]) -> str:
    payload = {
        "phase": phase,
        "version": version,
        "config": cfg.training_hash(),
        "iteration": iteration,
        "inputs": {name: sha256_file(p) for name, p in sorted(inputs.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _check_inputs(iteration: int, phase: str, inputs: dict[str, Path]) -> None:
    missing = [f"{n} ({p})" for n, p in inputs.items() if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"{phase} (iteration {iteration}) is missing its input(s): {', '.join(missing)}")


def record_digest(record: dict[str, Any]) -> str:
    """sha256 of a record's content but its own digest: a changed time or statistic shows like a changed output."""
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _valid_record(cfg: PPOConfig, iteration: int, phase: str, key: str) -> dict[str, Any] | None:
    path = cfg.layout.phase_record(iteration, phase)
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("key") != key:
            return None
        # a damaged record has a digest that no longer fits (or none: a flipped bit in its name); a record
        # written before the digest existed runs its phase once more, to the same bytes
        if record.get("record_sha256") != record_digest(record):
            return None
        for name, p in record["outputs"].items():
            # a cached result never hands back a path to a file that is gone or altered
            if not Path(p).is_file() or sha256_file(Path(p)) != record["hashes"][name]:
                return None
        float(record["seconds"]), dict(record["stats"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a damaged record (bad UTF-8, JSON, fields): run again
        return None
    return record


def lookup(cfg: PPOConfig, iteration: int, phase: str, version: int, inputs: dict[str, Path]) -> PhaseResult | None:
    """The phase's verified earlier result, or None when it has to run."""
    _check_inputs(iteration, phase, inputs)
    record = _valid_record(cfg, iteration, phase, cache_key(cfg, iteration, phase, version, inputs))
    if record is None:
        return None
    return PhaseResult(phase, iteration, record["outputs"], record["hashes"], True, record["seconds"], record["stats"])


def run_phase(
    cfg: PPOConfig,
    iteration: int,
    phase: str,
    version: int,
    inputs: dict[str, Path],
    compute: Compute,
    earlier_seconds: float = 0.0,
) -> PhaseResult:
    """Reuse the phase's outputs when inputs, config and code are unchanged; else compute and record them.

    ``earlier_seconds``: time the phase already spent elsewhere (its shards, before a merge), counted in its record.
    """
    with scope(f"{iter_label(iteration)}/{phase}"):
        return _run_phase(cfg, iteration, phase, version, inputs, compute, earlier_seconds)


def _run_phase(
    cfg: PPOConfig, iteration: int, phase: str, version: int, inputs: dict[str, Path], compute: Compute, earlier_seconds: float
) -> PhaseResult:
    cached = lookup(cfg, iteration, phase, version, inputs)
    if cached is not None:
        return cached
    key = cache_key(cfg, iteration, phase, version, inputs)
    t0 = time.perf_counter()
    outputs, stats = compute()
    seconds = time.perf_counter() - t0 + earlier_seconds
    out = {n: str(p) for n, p in outputs.items()}
    hashes = {n: sha256_file(Path(p)) for n, p in outputs.items()}
    # where it ran: with Ray workers the flow's process is not the one that computed a shard
    ran_on = {"host": socket.gethostname(), "pid": os.getpid()}
    record = {"key": key, "outputs": out, "hashes": hashes, "seconds": seconds, "stats": stats, "ran_on": ran_on}
    record["record_sha256"] = record_digest(record)
    atomic_write_text(cfg.layout.phase_record(iteration, phase), json.dumps(record, indent=2, sort_keys=True))
    failpoint("phase.done")
    return PhaseResult(phase, iteration, out, hashes, False, seconds, stats)
