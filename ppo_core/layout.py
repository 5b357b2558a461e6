"""Where everything lives on disk: the one module that spells a path or file name of the store.

::

    <root>/
      models/                          converted base models
      reward_models/<name>.safetensors learned reward models (+ .json sidecar)
      mlflow.db, mlruns/               the embedded MLflow store
      run=<run>/
        run.json                       the run's pinned config
        .lock                          held by the process training the run
        report.html
        iter=<NNNN>/
          <table>.parquet              rollouts, sa_pairs, rewards, values, advantages, metrics, eval
          checkpoint/<adapter>_adapter.safetensors, <adapter>_optimizer.safetensors
          phases/<phase>.json          each phase's cache key and output hashes
          parts/part-<i>-of-<n>/<table>.parquet   a shard's rows of a data-parallel phase
          manifest.json                written last: the iteration is complete

``run`` and ``iter`` are hive partition keys, so DuckDB and Polars read them as
columns. Nothing here imports the rest of ``ppo_core``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_ITER_DIR = re.compile(r"^iter=(\d{4,})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_name(v: str) -> str:
    """A run or reward-model name becomes a folder or file name: no separators, no '..'."""
    if not _NAME.match(v) or ".." in v:
        raise ValueError(
            "must be 1-100 characters of letters, digits, '_', '-' or '.', start with a letter "
            "or digit, and contain no path separator or '..'"
        )
    return v


def iter_label(iteration: int) -> str:
    """``iter=NNNN``: the partition folder of an iteration, also used to label its MLflow artifacts."""
    return f"iter={iteration:04d}"


def parse_iter_label(name: str) -> int | None:
    """The iteration of folder name ``iter=NNNN``, or None for any other name (a stray folder)."""
    m = _ITER_DIR.match(name)
    return int(m.group(1)) if m else None


def run_label(run: str) -> str:
    return f"run={run}"


def parse_run_label(name: str) -> str | None:
    """The run of folder name ``run=<run>``, or None for any other name."""
    run = name.removeprefix("run=")
    if run == name:
        return None
    try:
        return check_name(run)
    except ValueError:
        return None


def table_file(name: str) -> str:
    return f"{name}.parquet"


def table_glob(root: Path, name: str) -> Path:
    """Pattern matching table ``name`` of every iteration of every run (for DuckDB's read_parquet)."""
    # iteration folders only: a stray iter=foo folder would fail DuckDB's integer cast of the partition key
    # (four digits: iterations 0-9999; iter=0002.bak and the like stay out too)
    return Path(root) / "run=*" / "iter=[0-9][0-9][0-9][0-9]" / table_file(name)


def models_dir(root: Path) -> Path:
    return Path(root) / "models"


def converted_model_dir(root: Path, name: str) -> Path:
    """A base model converted once (from GGUF) to an mlx_lm directory, named by its source digest."""
    return models_dir(root) / name


def reward_model_path(root: Path, name: str) -> Path:
    try:
        check_name(name)
    except ValueError as exc:
        raise ValueError(f"reward model name {name!r}: {exc}") from None
    return Path(root) / "reward_models" / f"{name}.safetensors"


def reward_model_sidecar(path: Path) -> Path:
    """The JSON beside a reward-model file: its layout, score statistics and training history."""
    return Path(path).with_suffix(".json")


def mlflow_db(root: Path) -> Path:
    return Path(root) / "mlflow.db"


def mlruns_dir(root: Path) -> Path:
    return Path(root) / "mlruns"


@dataclass(frozen=True)
class Checkpoint:
    """The adapter and optimiser-state files of one checkpoint folder."""

    dir: Path

    def adapter(self, name: str) -> Path:
        return self.dir / self.adapter_file_name(name)

    def adapter_files(self) -> list[Path]:
        """The adapter files this checkpoint holds."""
        return sorted(self.dir.glob(self.adapter_file_name("*")))

    def optimizer(self, name: str) -> Path:
        return self.dir / f"{name}_optimizer.safetensors"

    @staticmethod
    def adapter_file_name(name: str) -> str:
        """The file name of adapter ``name`` (also its name among a run's MLflow artifacts)."""
        return f"{name}_adapter.safetensors"


@dataclass(frozen=True)
class RunLayout:
    """Every path of one run under one artifact root."""

    root: Path
    run: str

    def __post_init__(self) -> None:
        # every reader (report, registry, queries) builds paths from a user-given name: refuse '../x' first
        try:
            check_name(self.run)
        except ValueError as exc:
            raise ValueError(f"run name {self.run!r}: {exc}") from None

    @property
    def run_dir(self) -> Path:
        return Path(self.root) / run_label(self.run)

    @property
    def run_json(self) -> Path:
        return self.run_dir / "run.json"

    @property
    def lock(self) -> Path:
        return self.run_dir / ".lock"

    @property
    def report(self) -> Path:
        return self.run_dir / "report.html"

    def iter_dir(self, iteration: int) -> Path:
        return self.run_dir / iter_label(iteration)

    def table(self, iteration: int, name: str) -> Path:
        return self.iter_dir(iteration) / table_file(name)

    def part_dir(self, iteration: int, label: str) -> Path:
        """Where a shard of a data-parallel phase writes its part of a table (outside the tables' glob)."""
        return self.iter_dir(iteration) / "parts" / label

    def checkpoint(self, iteration: int) -> Checkpoint:
        """Iteration N's checkpoint is what iteration N+1 samples and scores with; 0 holds the seeded start."""
        return Checkpoint(self.iter_dir(iteration) / "checkpoint")

    def phase_record(self, iteration: int, phase: str) -> Path:
        return self.iter_dir(iteration) / "phases" / f"{phase}.json"

    def manifest(self, iteration: int) -> Path:
        return self.iter_dir(iteration) / "manifest.json"

    def iterations(self) -> list[int]:
        """Every iteration with a folder, complete or not; stray folders (``iter=foo``) are ignored."""
        found = (parse_iter_label(p.name) for p in self.run_dir.glob("iter=*") if p.is_dir())
        return sorted(i for i in found if i is not None)

    def completed_iterations(self) -> list[int]:
        """Iterations that finished: the pipeline writes manifest.json after the last phase."""
        return [i for i in self.iterations() if self.manifest(i).is_file()]

    def has_table(self, name: str) -> bool:
        """Whether any iteration of the run holds table ``name``."""
        return any(self.run_dir.glob(f"iter=*/{table_file(name)}"))
