"""Arrow schemas of the experience tables, atomic writes, content hashes.

Where a table lives is ``ppo_core.layout``'s business. The three token tables
have one row per generated token; no row ever stores the state text (quadratic).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from ppo_core.faults import failpoint
from ppo_core.layout import table_file

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

TOKEN_KEY = [("rollout_id", pa.int32()), ("t", pa.int32())]  # one row per generated token


def _float32(*names: str) -> list[tuple[str, pa.DataType]]:
    return [(n, pa.float32()) for n in names]


# kl = logprob - ref_logprob (the k1 estimator)
SA_PAIRS = pa.schema(
    [*TOKEN_KEY, ("token_id", pa.int32()), ("token", pa.string()), *_float32("logprob", "ref_logprob", "kl", "entropy")]
)

# score is non-zero at the last token only; kl_penalty = -kl_coef * kl; reward = score + kl_penalty
REWARDS = pa.schema([*TOKEN_KEY, *_float32("score", "kl_penalty", "reward")])

VALUES = pa.schema([*TOKEN_KEY, *_float32("value")])

ADVANTAGES = pa.schema([*TOKEN_KEY, *_float32("value", "td_error", "advantage", "whitened_advantage", "return")])

METRICS = pa.schema(
    [
        *[(n, pa.int32()) for n in ("step", "epoch", "minibatch")],
        *_float32(
            "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "value_clip_fraction",
            "policy_grad_norm", "value_grad_norm",
        ),
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
        # what the policy generated, as scored (older eval tables lack these two; the views union by name)
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
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
            failpoint("table.write", final.name)  # the temporary file is complete, the final name not yet taken
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
    path = iter_dir / table_file(name)
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
