"""Arrow schemas of the experience tables, atomic Parquet writes, manifests.

Layout: ``<root>/run=<run>/iter=<NNNN>/<table>.parquet`` so DuckDB and Polars
read ``run`` and ``iter`` as hive partitions. The three token tables have one
row per generated token; no row ever stores the state text (quadratic).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from ppo_core.faults import failpoint

ROLLOUTS = pa.schema(
    [
        ("rollout_id", pa.int32()),
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),  # 'eos' | 'length'
        ("sampling_logprobs", pa.list_(pa.float32())),
        ("seed", pa.int64()),
    ]
)

SA_PAIRS = pa.schema(
    [
        ("rollout_id", pa.int32()),
        ("t", pa.int32()),
        ("token_id", pa.int32()),
        ("token", pa.string()),
        ("logprob", pa.float32()),
        ("ref_logprob", pa.float32()),
        ("kl", pa.float32()),  # logprob - ref_logprob (k1 estimator)
        ("entropy", pa.float32()),
    ]
)

REWARDS = pa.schema(
    [
        ("rollout_id", pa.int32()),
        ("t", pa.int32()),
        ("score", pa.float32()),  # non-zero at the last token only
        ("kl_penalty", pa.float32()),  # -kl_coef * kl
        ("reward", pa.float32()),  # score + kl_penalty
    ]
)

VALUES = pa.schema([("rollout_id", pa.int32()), ("t", pa.int32()), ("value", pa.float32())])

ADVANTAGES = pa.schema(
    [
        ("rollout_id", pa.int32()),
        ("t", pa.int32()),
        ("value", pa.float32()),
        ("td_error", pa.float32()),
        ("advantage", pa.float32()),
        ("whitened_advantage", pa.float32()),
        ("return", pa.float32()),
    ]
)

METRICS = pa.schema(
    [
        ("step", pa.int32()),
        ("epoch", pa.int32()),
        ("minibatch", pa.int32()),
        ("policy_loss", pa.float32()),
        ("value_loss", pa.float32()),
        ("entropy", pa.float32()),
        ("approx_kl", pa.float32()),
        ("clip_fraction", pa.float32()),
        ("value_clip_fraction", pa.float32()),
        ("policy_grad_norm", pa.float32()),
        ("value_grad_norm", pa.float32()),
    ]
)

EVAL = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("response_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("score", pa.float32()),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "rollouts": ROLLOUTS,
    "sa_pairs": SA_PAIRS,
    "rewards": REWARDS,
    "values": VALUES,
    "advantages": ADVANTAGES,
    "metrics": METRICS,
    "eval": EVAL,
}
TOKEN_TABLES = ("sa_pairs", "rewards", "advantages")


class TableError(RuntimeError):
    """A table is missing, damaged, or does not match its schema."""


class ArtifactWriteError(OSError):
    """An artifact could not be written (disk full, not writable); nothing was replaced."""


@functools.cache
def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask.

    mkstemp creates 0600 files; artifacts keep the usual mode instead, so a
    tracking server or a teammate under another account can read the store.
    Read once: the umask can only be read by setting it.
    """
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename onto it only on success.

    A killed process leaves at most a ``.tmp`` file, never a half file under
    the final name.
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # keep the real suffix last: some writers (mx.save_safetensors) append theirs otherwise
        fd, tmp_name = tempfile.mkstemp(prefix=f".{final.stem}.", suffix=f".tmp{final.suffix}", dir=final.parent)
    except OSError as exc:
        raise ArtifactWriteError(f"cannot write {final}: {exc.strerror or exc}") from exc
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            os.chmod(tmp, _new_file_mode())
            yield tmp
            failpoint("table.write")  # the temporary file is complete, the final name not yet taken
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:  # disk full, quota, permissions: the old file (if any) is untouched
            raise ArtifactWriteError(f"cannot write {final}: {exc.strerror or exc}; nothing was replaced") from exc
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def table_path(iter_dir: Path, name: str) -> Path:
    return iter_dir / f"{name}.parquet"


def write_table(
    iter_dir: Path, name: str, data: pa.Table | dict[str, Any], metadata: dict[str, str] | None = None
) -> Path:
    """Validate against the table's schema and write it atomically (zstd)."""
    schema = SCHEMAS[name]
    try:
        table = data if isinstance(data, pa.Table) else pa.table(data)
        table = table.select(schema.names).cast(schema)
        if metadata:
            table = table.replace_schema_metadata(metadata)
    except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
        raise TableError(f"{name}: data does not match its schema: {exc}") from exc
    path = table_path(iter_dir, name)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def read_table(path: Path | str) -> pa.Table:
    path = Path(path)
    if not path.is_file():
        raise TableError(f"table {path} is missing")
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TableError(f"table {path} is unreadable (damaged?): {exc}") from exc


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(iter_dir: Path, entries: dict[str, Any]) -> Path:
    path = iter_dir / "manifest.json"
    atomic_write_text(path, json.dumps(entries, indent=2, sort_keys=True))
    return path
