"""Prompt files: JSONL with one {"prompt_id", "prompt"} object per line (or plain text lines)."""

from __future__ import annotations

from pathlib import Path

import polars as pl


class PromptsError(ValueError):
    """The prompts file is missing, empty, not UTF-8, or malformed."""


MAX_PROMPTS_BYTES = 256 << 20  # read whole; far beyond any prompt set sampled a batch at a time


def load_prompts(path: Path) -> pl.DataFrame:
    """Columns prompt_id (str), prompt (str); validated, order preserved."""
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"prompts file {path} does not exist")
    size = path.stat().st_size
    if size > MAX_PROMPTS_BYTES:
        raise PromptsError(
            f"prompts file {path} is {size / 2**20:.0f} MB, more than the {MAX_PROMPTS_BYTES >> 20} MB a prompts "
            "file may hold (each iteration samples batch_size prompts of it): split or subsample it"
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptsError(f"prompts file {path} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start+1]!r})") from None
    if not text.strip():
        raise PromptsError(f"prompts file {path} is empty")
    text = text.removeprefix("\ufeff")
    if path.suffix == ".jsonl":
        try:
            df = pl.read_ndjson(text.encode(), infer_schema_length=None)
        except Exception as exc:
            raise PromptsError(f"prompts file {path} is not valid JSONL: {exc}") from None
        if "prompt" not in df.columns:
            raise PromptsError(f"prompts file {path}: every line needs a 'prompt' field")
        if df.schema["prompt"] not in (pl.String, pl.Null):
            raise PromptsError(f"prompts file {path}: 'prompt' must be text (found {df.schema['prompt']})")
        if "prompt_id" not in df.columns:
            df = df.with_columns(pl.lit(None, dtype=pl.String).alias("prompt_id"))
        # lines without an id get their line number
        df = df.with_row_index("line").select(
            pl.coalesce(pl.col("prompt_id").cast(pl.String), pl.col("line").cast(pl.String)).alias("prompt_id"),
            pl.col("prompt"),
        )
    else:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        df = pl.DataFrame({"prompt_id": [str(i) for i in range(len(lines))], "prompt": lines})
    empty = df.filter(pl.col("prompt").is_null() | (pl.col("prompt").str.strip_chars() == ""))
    if empty.height:
        raise PromptsError(f"prompts file {path}: prompt {empty['prompt_id'][0]!r} is empty")
    dupes = df.filter(pl.col("prompt_id").is_duplicated())
    if dupes.height:
        raise PromptsError(f"prompts file {path}: prompt_id {dupes['prompt_id'][0]!r} appears more than once")
    return df


def check_prompt_lengths(df: pl.DataFrame, token_counts: list[int], max_new_tokens: int, context: int, path: Path) -> None:
    """Refuse prompts that leave no room for the response inside the model context."""
    too_long = [i for i, n in enumerate(token_counts) if n + max_new_tokens > context]
    if too_long:
        i = too_long[0]
        raise PromptsError(
            f"prompts file {path}: prompt {df['prompt_id'][i]!r} is {token_counts[i]} tokens; with "
            f"max_new_tokens={max_new_tokens} it exceeds the model context of {context} tokens"
        )
