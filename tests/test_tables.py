"""Experience-table schemas, atomic writes and damaged-file detection."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_core.layout import table_file
from ppo_core.tables import (
    SCHEMAS,
    TableError,
    atomic_path,
    atomic_write_text,
    read_table,
    write_table,
)


def sample_value(t: pa.DataType, i: int):
    if pa.types.is_list(t):
        return [sample_value(t.value_type, i + k) for k in range(i % 3 + 1)]
    if pa.types.is_integer(t):
        return i * 3 + 1
    if pa.types.is_floating(t):
        return i * 0.5 - 0.25  # exactly representable in float32
    if pa.types.is_string(t):
        return f"s{i} ünï"
    raise AssertionError(f"no sample for {t}")


def sample_table(schema: pa.Schema, n: int = 3) -> dict[str, list]:
    return {f.name: [sample_value(f.type, i) for i in range(n)] for f in schema}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_round_trip(tmp_path: Path, name: str):
    schema = SCHEMAS[name]
    data = sample_table(schema)
    data["extra_column"] = [1, 2, 3]  # dropped: only schema columns are written
    path = write_table(tmp_path / "iter", name, data, metadata={"k": "v"})
    assert path == tmp_path / "iter" / table_file(name)
    assert path.is_file()
    back = read_table(path)
    assert back.schema.names == schema.names
    assert back.schema.remove_metadata().equals(schema)
    assert back.schema.metadata == {b"k": b"v"}
    assert back.to_pydict() == {k: v for k, v in data.items() if k != "extra_column"}
    # nothing but the table in the directory (no leftover temp files)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_round_trip_from_arrow_table_reordered(tmp_path: Path, name: str):
    schema = SCHEMAS[name]
    data = sample_table(schema, n=2)
    reordered = pa.table({k: data[k] for k in reversed(schema.names)})
    back = read_table(write_table(tmp_path, name, reordered))
    assert back.schema.names == schema.names
    assert back.to_pydict() == data


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_missing_column_raises(tmp_path: Path, name: str):
    data = sample_table(SCHEMAS[name])
    dropped = SCHEMAS[name].names[-1]
    del data[dropped]
    with pytest.raises(TableError, match=name):
        write_table(tmp_path, name, data)
    assert not (tmp_path / table_file(name)).exists()


def test_wrong_type_raises(tmp_path: Path):
    data = sample_table(SCHEMAS["values"])
    data["value"] = ["not", "a", "float"]
    with pytest.raises(TableError):
        write_table(tmp_path, "values", data)
    data = sample_table(SCHEMAS["values"])
    data["t"] = [2**40, 0, 1]  # overflows int32
    with pytest.raises(TableError):
        write_table(tmp_path, "values", data)


def test_atomic_path_success(tmp_path: Path):
    final = tmp_path / "sub" / "out.txt"
    with atomic_path(final) as tmp:
        assert tmp.parent == final.parent
        assert tmp != final
        assert tmp.name.endswith(".txt")  # the real suffix stays last
        tmp.write_text("hello")
        assert not final.exists()  # not visible before the body finishes
    assert final.read_text() == "hello"
    assert [p.name for p in final.parent.iterdir()] == ["out.txt"]


def test_artifacts_get_the_mode_of_a_plain_open_not_mkstemps_0600(tmp_path: Path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # what the user's umask gives any new file
    written = write_table(tmp_path, "values", sample_table(SCHEMAS["values"]))
    atomic_write_text(tmp_path / "manifest.json", "{}")
    expected = plain.stat().st_mode & 0o777
    assert expected & 0o044, "the test needs a umask that lets group/others read"
    for path in (written, tmp_path / "manifest.json"):
        assert path.stat().st_mode & 0o777 == expected, path


def test_atomic_path_failure_leaves_nothing(tmp_path: Path):
    final = tmp_path / "out.parquet"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("boom")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_failure_keeps_existing_file(tmp_path: Path):
    final = tmp_path / "out.txt"
    final.write_text("original")
    with pytest.raises(KeyError):
        with atomic_path(final) as tmp:
            tmp.write_text("replacement")
            raise KeyError("x")
    assert final.read_text() == "original"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_path_success_replaces_existing(tmp_path: Path):
    final = tmp_path / "out.txt"
    final.write_text("original")
    atomic_write_text(final, "new")
    assert final.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_write_table_failure_keeps_existing(tmp_path: Path):
    good = write_table(tmp_path, "values", sample_table(SCHEMAS["values"]))
    before = good.read_bytes()
    bad = sample_table(SCHEMAS["values"])
    del bad["value"]
    with pytest.raises(TableError):
        write_table(tmp_path, "values", bad)
    assert good.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [good.name]


def test_read_missing_table(tmp_path: Path):
    with pytest.raises(TableError, match="missing"):
        read_table(tmp_path / "absent.parquet")


def test_read_truncated_table(tmp_path: Path):
    path = write_table(tmp_path, "rewards", sample_table(SCHEMAS["rewards"], n=50))
    raw = path.read_bytes()
    for cut in (len(raw) // 2, len(raw) - 3, 4):
        bad = tmp_path / f"cut{cut}.parquet"
        bad.write_bytes(raw[:cut])
        with pytest.raises(TableError, match=bad.name):
            read_table(bad)


@pytest.mark.parametrize("content", [b"", b"not a parquet file at all", os.urandom(256), b"PAR1" + b"\0" * 40 + b"PAR1"])
def test_read_garbage_table(tmp_path: Path, content: bytes):
    bad = tmp_path / "garbage.parquet"
    bad.write_bytes(content)
    with pytest.raises(TableError, match="garbage.parquet"):
        read_table(bad)


def test_read_table_accepts_str(tmp_path: Path):
    data = sample_table(SCHEMAS["values"])
    path = write_table(tmp_path, "values", data)
    assert read_table(str(path)).to_pydict() == data
    # and it is a real parquet file others can read
    assert pq.read_table(path).num_rows == 3
