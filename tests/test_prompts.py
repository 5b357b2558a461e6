"""Prompt files: JSONL and plain text, and every way they can be malformed."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import json
from pathlib import Path

import polars as pl
import pytest

from ppo_core.prompts import PromptsError, check_prompt_lengths, load_prompts


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_jsonl(tmp_path: Path):
    p = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt_id": "a", "prompt": "Hello there"}, {"prompt_id": "b", "prompt": "Café ☕ time", "extra": 1},
         {"prompt_id": "c", "prompt": "Third"}],
    )
    df = load_prompts(p)
    assert df.columns == ["prompt_id", "prompt"]
    assert df.schema["prompt_id"] == pl.String and df.schema["prompt"] == pl.String
    assert df["prompt_id"].to_list() == ["a", "b", "c"]
    assert df["prompt"].to_list() == ["Hello there", "Café ☕ time", "Third"]


def test_load_jsonl_without_ids_and_numeric_ids(tmp_path: Path):
    df = load_prompts(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, {"prompt": "y"}]))
    assert df["prompt_id"].to_list() == ["0", "1"]
    df = load_prompts(write_jsonl(tmp_path / "b.jsonl", [{"prompt_id": 7, "prompt": "x"}, {"prompt_id": 9, "prompt": "y"}]))
    assert df["prompt_id"].to_list() == ["7", "9"]
    assert df.schema["prompt_id"] == pl.String


def test_load_plain_text(tmp_path: Path):
    p = tmp_path / "p.txt"
    p.write_text("  first prompt  \n\nsecond prompt\n   \nthird\n", encoding="utf-8")
    df = load_prompts(p)
    assert df.columns == ["prompt_id", "prompt"]
    assert df["prompt"].to_list() == ["first prompt", "second prompt", "third"]
    assert df["prompt_id"].to_list() == ["0", "1", "2"]


def test_missing_file(tmp_path: Path):
    with pytest.raises(PromptsError, match="does not exist"):
        load_prompts(tmp_path / "absent.jsonl")


def test_directory_is_not_a_file(tmp_path: Path):
    with pytest.raises(PromptsError):
        load_prompts(tmp_path)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt"])
@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file(tmp_path: Path, name, content):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(PromptsError, match="empty"):
        load_prompts(p)


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.txt"])
def test_not_utf8(tmp_path: Path, name):
    p = tmp_path / name
    p.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptsError, match="not UTF-8") as info:
        load_prompts(p)
    assert name in str(info.value)


def test_jsonl_without_prompt_field(tmp_path: Path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt_id": "a", "text": "x"}, {"prompt_id": "b", "text": "y"}])
    with pytest.raises(PromptsError, match="'prompt'"):
        load_prompts(p)


def test_jsonl_one_line_without_prompt(tmp_path: Path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt_id": "a", "prompt": "x"}, {"prompt_id": "b", "text": "y"}])
    with pytest.raises(PromptsError, match="'b'"):
        load_prompts(p)


def test_invalid_json_line(tmp_path: Path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_id": "a", "prompt": "x"}\n{"prompt_id": "b", "prompt": \n', encoding="utf-8")
    with pytest.raises(PromptsError, match="JSONL"):
        load_prompts(p)


def test_duplicate_prompt_id(tmp_path: Path):
    p = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt_id": "a", "prompt": "x"}, {"prompt_id": "dup", "prompt": "y"}, {"prompt_id": "dup", "prompt": "z"}],
    )
    with pytest.raises(PromptsError, match="'dup'.*more than once"):
        load_prompts(p)


@pytest.mark.parametrize("empty", ["", "   ", "\t\n"])
def test_empty_prompt(tmp_path: Path, empty):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt_id": "a", "prompt": "x"}, {"prompt_id": "blank", "prompt": empty}])
    with pytest.raises(PromptsError, match="'blank' is empty"):
        load_prompts(p)


def test_null_prompt(tmp_path: Path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt_id": "a", "prompt": "x"}, {"prompt_id": "n", "prompt": None}])
    with pytest.raises(PromptsError, match="'n'"):
        load_prompts(p)


def test_check_prompt_lengths_ok():
    df = pl.DataFrame({"prompt_id": ["a", "b"], "prompt": ["x", "y"]})
    # exactly filling the context is allowed
    check_prompt_lengths(df, [10, 24], max_new_tokens=40, context=64, path=Path("p.jsonl"))


def test_check_prompt_lengths_names_prompt():
    df = pl.DataFrame({"prompt_id": ["a", "long-one", "c", "also-long"], "prompt": ["x", "y", "z", "w"]})
    with pytest.raises(PromptsError, match="'long-one'") as info:
        check_prompt_lengths(df, [10, 25, 3, 100], max_new_tokens=40, context=64, path=Path("data/p.jsonl"))
    msg = str(info.value)
    assert "25 tokens" in msg and "max_new_tokens=40" in msg and "64" in msg and "p.jsonl" in msg
    assert "also-long" not in msg  # the first offender is reported


def test_lines_without_id_get_their_line_number(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt_id":"a","prompt":"x"}\n{"prompt":"y"}\n')
    assert load_prompts(p).rows() == [("a", "x"), ("1", "y")]


def test_non_text_prompt_and_bom(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt_id":"a","prompt":["x"]}\n')
    with pytest.raises(PromptsError, match="'prompt' must be text"):
        load_prompts(p)
    p.write_bytes('\ufeff{"prompt":"x"}\n'.encode())
    assert load_prompts(p).rows() == [("0", "x")]
