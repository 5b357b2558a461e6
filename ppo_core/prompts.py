"""Prompt files: JSONL with one {"prompt_id", "prompt"} object per line (or plain text lines).

A prompt reaches the rollouts table exactly as the file holds it (a JSONL
string's escapes decoded, nothing else; a plain-text line without its
surrounding whitespace). Whatever could not be stored that way is refused with
the file and its line named, never repaired.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import polars as pl


class PromptsError(ValueError):
    """The prompts file is missing, empty, not UTF-8, or malformed."""


MAX_PROMPTS_BYTES = 256 << 20  # read whole; far beyond any prompt set sampled a batch at a time
# lines of a file: \n, \r\n or a lone \r; not str.splitlines's other breaks (\x0b, \x0c, \x1c-\x1e, \x85,
# \u2028, \u2029), which are characters inside a prompt
_LINE_BREAK = re.compile(r"\r\n|\n|\r")
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}


def _read_text(path: Path) -> str:
    """The file's text, without a UTF-8 byte-order mark; refused unless it is UTF-8."""
    try:
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "does not exist"
            raise PromptsError(f"prompts file {path} {what}")
        size = path.stat().st_size
        if size > MAX_PROMPTS_BYTES:
            raise PromptsError(
                f"prompts file {path} is {size / 2**20:.0f} MB, more than the {MAX_PROMPTS_BYTES >> 20} MB a prompts "
                "file may hold (each iteration samples batch_size prompts of it): split or subsample it"
            )
        raw = path.read_bytes()
    except OSError as exc:  # a name too long, no permission, an unreadable device
        raise PromptsError(f"prompts file {path} cannot be read: {exc.strerror or exc}") from None
    for bom, encoding in _BOMS.items():
        if raw.startswith(bom):
            raise PromptsError(f"prompts file {path} is {encoding} (it starts with a {encoding} byte-order mark): save it as UTF-8")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = len(_LINE_BREAK.findall(raw[: exc.start].decode("utf-8"))) + 1  # the bytes before it are UTF-8
        raise PromptsError(
            f"prompts file {path} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start+1]!r}, line {line})"
        ) from None
    head = raw[:256]
    if len(head) >= 16 and head.count(0) * 3 >= len(head):
        raise PromptsError(
            f"prompts file {path} is full of NUL bytes ({head.count(0)} of its first {len(head)}): it looks like "
            "UTF-16 or UTF-32 without a byte-order mark; save it as UTF-8"
        )
    return text.removeprefix("\ufeff")


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in ``text`` (a JSON escape such as \\ud800 that is no character), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return text[exc.start]
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, refusing a key given twice (JSON parsers disagree on which one counts)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} appears twice in one object")
    return obj


def _kind(value: Any) -> str:
    return {str: "text", dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _parse_jsonl(path: Path, text: str) -> tuple[list[str], list[str | None], list[int]]:
    """(prompt ids, prompts, line numbers) of the non-blank lines; a missing id is the row's number."""
    ids: list[str] = []
    prompts: list[str | None] = []
    line_numbers: list[int] = []
    for number, line in enumerate(_LINE_BREAK.split(text), start=1):
        if not line.strip():
            continue
        where = f"prompts file {path}: line {number}"
        try:
            obj = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise PromptsError(f"prompts file {path} is not valid JSONL: line {number}: {exc.msg.removesuffix(' at')} (column {exc.colno})") from None
        except (ValueError, RecursionError) as exc:  # a duplicate key, an integer beyond the digit limit, deep nesting
            raise PromptsError(f"prompts file {path} is not valid JSONL: line {number}: {exc or type(exc).__name__}") from None
        if not isinstance(obj, dict):
            raise PromptsError(f"{where} is {_kind(obj)}, not a JSON object with a 'prompt' field")
        pid = obj.get("prompt_id")
        if pid is None:
            pid = str(len(ids))  # lines without an id get their row's number
        elif isinstance(pid, int) and not isinstance(pid, bool):
            pid = str(pid)
        elif not isinstance(pid, str):
            raise PromptsError(f"{where}: 'prompt_id' must be text or an integer (found {_kind(pid)})")
        if "prompt" not in obj:
            raise PromptsError(f"{where} (prompt {pid!r}) has no 'prompt' field: every line needs one")
        prompt = obj["prompt"]
        if prompt is not None and not isinstance(prompt, str):
            raise PromptsError(f"{where} (prompt {pid!r}): 'prompt' must be text (found {_kind(prompt)})")
        for name, value in (("prompt_id", pid), ("prompt", prompt)):
            bad = _lone_surrogate(value) if value is not None else None
            if bad is not None:
                raise PromptsError(
                    f"{where}: '{name}' holds the escape {json.dumps(bad)}, a lone surrogate that is no character "
                    "(a table cannot store it): fix the file's encoder"
                )
        ids.append(pid)
        prompts.append(prompt)
        line_numbers.append(number)
    return ids, prompts, line_numbers


def load_prompts(path: Path) -> pl.DataFrame:
    """Columns prompt_id (str), prompt (str); validated, order preserved."""
    path = Path(path)
    text = _read_text(path)
    if not text.strip():
        raise PromptsError(f"prompts file {path} is empty")
    if path.suffix == ".jsonl":
        ids, prompts, line_numbers = _parse_jsonl(path, text)
    else:
        numbered = [(n, ln.strip()) for n, ln in enumerate(_LINE_BREAK.split(text), start=1) if ln.strip()]
        line_numbers = [n for n, _ in numbered]
        prompts = [ln for _, ln in numbered]
        ids = [str(i) for i in range(len(prompts))]
    if not ids:
        raise PromptsError(f"prompts file {path} is empty")
    for pid, prompt, number in zip(ids, prompts, line_numbers):
        if prompt is None or not prompt.strip():
            raise PromptsError(f"prompts file {path}: prompt {pid!r} is empty (line {number})")
    first_line: dict[str, int] = {}
    for pid, number in zip(ids, line_numbers):
        if pid in first_line:
            raise PromptsError(
                f"prompts file {path}: prompt_id {pid!r} appears more than once (lines {first_line[pid]} and {number})"
            )
        first_line[pid] = number
    return pl.DataFrame({"prompt_id": ids, "prompt": prompts}, schema={"prompt_id": pl.String, "prompt": pl.String})


def context_length(max_position_embeddings: int | None, tokenizer: Any) -> int:
    """A model's context in tokens: its config's ``max_position_embeddings``, else what its tokenizer says."""
    return int(max_position_embeddings or getattr(tokenizer, "model_max_length", 2048))


def check_prompt_lengths(df: pl.DataFrame, token_counts: list[int], max_new_tokens: int, context: int, path: Path) -> None:
    """Refuse prompts that leave no room for the response inside the model context."""
    too_long = [i for i, n in enumerate(token_counts) if n + max_new_tokens > context]
    if too_long:
        i = too_long[0]
        raise PromptsError(
            f"prompts file {path}: prompt {df['prompt_id'][i]!r} is {token_counts[i]} tokens; with "
            f"max_new_tokens={max_new_tokens} it exceeds the model context of {context} tokens"
        )
