"""Fuzzed input: config values, prompt files and `ppo train --set` strings.

Every case either passes validation or is refused with a message naming the
field (or the file), as a ConfigError / PromptsError or a one-line `ppo train`
exit 2: never a traceback, never another exception type, and nothing written
under the artifact root. Prompt files that pass run one iteration on the tiny
model and reach the rollouts table byte for byte.
"""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import types
import typing
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.config import ConfigError, PPOConfig, load_config
from ppo_core.prompts import PromptsError, load_prompts

FIELDS = sorted(PPOConfig.model_fields)
# every character, lone surrogates and control characters included
ANY_CHAR = st.characters(codec=None, exclude_categories=())
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _norm(text: str) -> str:
    """Whitespace as the CLI prints a message (runs of it become one space)."""
    return " ".join(text.split())


def names(fragment: str, message: str) -> bool:
    """Whether ``message`` names ``fragment``, as typed or as its repr (control characters, lone surrogates)."""
    return any(_norm(f) in _norm(message) for f in (fragment, repr(fragment), repr(fragment)[1:-1]) if _norm(f))


@contextlib.contextmanager
def scratch():
    """A fresh folder (removed afterwards), also the working directory: relative paths land in it."""
    tmp = Path(tempfile.mkdtemp(prefix="ppo-fuzz-"))
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        yield tmp
    finally:
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- config values

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-10, 10),
    st.integers(-(2**80), 2**80),
    st.floats(),  # NaN and +-inf included
    st.floats(-2, 2),
    st.sampled_from([0, -0.0, 5e-324, 1e308, 2**31, 2**31 - 1, 2**63, 10**400, float("nan"), float("inf"), -float("inf")]),
    st.text(ANY_CHAR, max_size=12),
    st.sampled_from([
        "", " ", "vader", "length", "keyword:good", "keyword:", "model:", "model:/nope.safetensors", "python:no_such_module_x:f",
        "python:~nobody-here/r.py:f", "python:r.py:f", "~nobody-here/x", "~", "/", ".", "a" * 300, "a/" * 2100, "q_proj,v_proj",
        "q_proj,,", "gae", "grpo", "auto", "float16", "cosine", "batch", "NaN", "1e999", "true", "run=x", "x\x00y",
        "\ud800", "/tmp/\udc80", "smollm2",
    ]),
    st.binary(max_size=6),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=3), SCALARS, max_size=2))
KEYS = st.one_of(st.sampled_from(FIELDS), st.text(ANY_CHAR, max_size=12))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "nope", ""]


def near(name: str) -> st.SearchStrategy:
    """Values around what field ``name`` accepts: its default and options, numbers of its size, sign flips, edges."""
    info = PPOConfig.model_fields[name]
    default = info.default
    if typing.get_origin(info.annotation) is typing.Literal:
        return st.sampled_from([*typing.get_args(info.annotation), "none", "GAE", ""])
    if isinstance(default, bool):
        return st.one_of(st.booleans(), st.sampled_from([0, 1, 2, "yes", "false"]))
    if isinstance(default, int):
        return st.one_of(st.integers(-2, max(8, 2 * default)), st.sampled_from([default, -default, default + 1, 0, 2**31]))
    if isinstance(default, float):
        top = max(2.0, 2 * abs(default))
        return st.one_of(st.floats(-top, top), st.sampled_from([default, -default, 0.0, -0.0, 1.0, 1e-9, 10.0, 1001.0]))
    if isinstance(default, tuple):
        return st.one_of(st.lists(st.sampled_from(TARGETS), max_size=4), st.lists(st.sampled_from(TARGETS), max_size=4).map(",".join))
    return st.sampled_from([str(default), default])  # names and paths: the default (fuzzed text comes from VALUES)


FIELD_VALUES = st.sampled_from(FIELDS).flatmap(lambda f: st.tuples(st.just(f), st.one_of(near(f), near(f), VALUES)))


@settings(FUZZ, max_examples=400)
@given(overrides=st.one_of(
    st.lists(FIELD_VALUES, min_size=1, max_size=4).map(dict), st.dictionaries(KEYS, VALUES, min_size=1, max_size=4)
))
@example(overrides={"prompts_path": "/tmp/\udc80"})  # was accepted, then run.json could not be written (not UTF-8)
@example(overrides={"model": "a\x00b"})  # was accepted, then 'embedded null byte' from deep inside preflight
@example(overrides={"reward": "python:~nobody-here/r.py:f"})  # RuntimeError from Path.expanduser leaked
@example(overrides={"artifact_root": "~nobody-here/x"})
@example(overrides={"model": "m" * 300})  # accepted, then OSError 'File name too long' in preflight
@example(overrides={1: 2, "x": 3})  # a key that is no text
def test_config_values_pass_or_name_the_field(overrides):
    try:
        cfg = load_config(None, dict(overrides))
    except ConfigError as exc:
        event("refused")
        msg = str(exc)
        assert "\n" not in msg, msg
        assert any(names(str(k), msg) for k in overrides), msg
        return
    event("passed")
    # a config that validates is one a run can pin (run.json) and read back, with the same identity
    again = PPOConfig(**json.loads(json.dumps(cfg.to_json_dict())))
    assert again == cfg and again.training_hash() == cfg.training_hash()


@settings(FUZZ, max_examples=200)
@given(fields=st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=4))
def test_ppoconfig_raises_only_validation_errors(fields):
    """The model itself (what flows and workers build from JSON) never lets another exception type out."""
    from pydantic import ValidationError

    try:
        PPOConfig(**fields)
    except ValidationError as exc:
        assert all(e["loc"] == () or e["loc"][0] in fields for e in exc.errors())


# ---------------------------------------------------------------- `ppo train --set`

NUMBERS_AS_TEXT = st.one_of(
    st.integers().map(str),
    st.floats().map(lambda f: json.dumps(f)),  # NaN, Infinity, -Infinity, 1e+308
    st.sampled_from(["1e999", "-1e999", "-0", "0x10", "1_000", "+1", ".5", "5.", "9" * 5000, "1" + "0" * 400]),
)
SET_VALUES = st.one_of(
    st.text(ANY_CHAR, max_size=16),
    NUMBERS_AS_TEXT,
    VALUES.map(lambda v: json.dumps(v, default=repr)),
    st.sampled_from(["[", "{", '{"a":', "[" * 3000, "[" * 3000 + "]" * 3000, '"x"', "null", "[]", "{}", ",", "a,b"]),
)
SET_ITEMS = st.one_of(
    FIELD_VALUES.map(lambda kv: f"{kv[0]}={kv[1] if isinstance(kv[1], str) else json.dumps(kv[1], default=repr)}"),
    FIELD_VALUES.map(lambda kv: f"{kv[0]}={kv[1] if isinstance(kv[1], str) else json.dumps(kv[1], default=repr)}"),
    st.tuples(KEYS, SET_VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.tuples(st.sampled_from(FIELDS), SET_VALUES).map(lambda kv: f" {kv[0]} ={kv[1]}"),
    st.text(ANY_CHAR, max_size=12),  # no '=' at all, or one anywhere
)


# how messages about a file or folder a field names call that field
ALIASES = {"prompts_path": "prompts file", "eval_prompts_path": "prompts file", "model": "model directory",
           "artifact_root": "artifact root"}


def invoke_train(root: Path, model_dir: Path, *sets: str, run: str = "t"):
    """`ppo train` with a stand-in flow: a case that passes the preflight records its call and starts nothing."""
    calls = []
    flow = types.ModuleType("flows.ppo")
    flow.ppo = lambda **kwargs: calls.append(kwargs) or {"stand-in": True}
    base = ["--set", f"artifact_root={root}", "--set", f"model={model_dir}", "--set", "batch_size=2", "--set", "eval_size=0"]
    args = ["train", "--run", run, *base, *[x for s in sets for x in ("--set", s)]]
    real = sys.modules.get("flows.ppo")
    sys.modules["flows.ppo"] = flow  # only this entry: modules imported meanwhile stay (a C extension loads once)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        if real is None:
            del sys.modules["flows.ppo"]
        else:
            sys.modules["flows.ppo"] = real
    return result, calls


def check_refusal(result, calls, root: Path, workdir: Path, *fragments: str, inputs: tuple[Path, ...] = ()) -> str:
    """A refused `ppo train`: exit 2, one line naming one of ``fragments``, no flow, nothing written but ``inputs``."""
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out, result.exception)
    assert not calls and "Traceback" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert any(names(f, out) for f in fragments), out
    assert not root.exists() and sorted(workdir.iterdir()) == sorted(inputs)
    return out


@settings(FUZZ, max_examples=250)
@given(items=st.lists(SET_ITEMS, min_size=1, max_size=3))
@example(items=["batch_size=" + "[" * 5000])  # RecursionError from json.loads: exit 1 with no message at all
@example(items=["batch_size=" + "9" * 5000])  # ValueError of Python's int digit limit, not naming the field
@example(items=["model=" + "m" * 5000])  # OSError 'File name too long': a traceback
@example(items=["artifact_root=/tmp/" + "a" * 300 + "/x"])
@example(items=["reward=python:/tmp/" + "x" * 300 + ".py:f"])
@example(items=["prompts_path=/proc/self/mem"])  # a file that exists but cannot be read: OSError, a traceback
@example(items=["model=\ud800"])  # "'utf-8' codec can't encode character", naming no field
@example(items=["\ud800=1"])
def test_train_set_strings_pass_or_are_refused_in_one_line(tiny_model_dir, items):
    with scratch() as workdir:
        root = workdir.parent / f"{workdir.name}-root"  # beside the working folder, never inside it
        result, calls = invoke_train(root, tiny_model_dir, *items)
        try:
            event(f"exit {result.exit_code}")
            if result.exit_code == 0:
                assert len(calls) == 1 and not root.exists() and not any(workdir.iterdir()), result.output
                return
            # the field (or what its messages call it), the whole item (one without '='), or the file a value names
            keys = [s.partition("=")[0].strip() for s in items]
            fragments = keys + [ALIASES.get(k, k) for k in keys] + list(items) + ["--set"]
            fragments += [value for _, _, value in (s.partition("=") for s in items) if len(value) >= 4]
            check_refusal(result, calls, root, workdir, *fragments)
        finally:
            shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- prompt files

PROMPT_TEXT = st.one_of(
    st.text(ANY_CHAR, max_size=24),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=24),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=24),
    st.sampled_from([
        "", " ", "\t\n", "\u2028", "\u00a0", "\x1c", "\x00", "a\x00b", "\r\n", "x\ry", "\ufeff", "\ud800", "a\udfffb",
        "\ud83d\ude00", "<|im_end|>", "Hello there", "caf\xe9", " padded ", "\x1b[31mred", "word " * 600, "x" * 200_000,
    ]),
)
IDS = st.one_of(
    st.none(), st.text(ANY_CHAR, max_size=6), st.integers(-3, 3), st.integers(), st.sampled_from(["", "0", "1", "a"]),
    st.floats(), st.booleans(), st.lists(st.integers(), max_size=2), st.just({"a": 1}),
)


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@st.composite
def jsonl_line(draw) -> tuple[str, tuple[str | None, str] | None]:
    """(line, (prompt_id or None, prompt) when it is a well-formed prompt line, else None)."""
    kind = draw(st.sampled_from(["object"] * 12 + ["blank", "garbage", "non-object", "duplicate", "truncated"]))
    if kind == "blank":
        return draw(st.sampled_from(["", " ", "\t", "  \t "])), None
    if kind == "garbage":
        return draw(st.text(ANY_CHAR, min_size=1, max_size=20)), None
    if kind == "non-object":
        return json.dumps(draw(st.one_of(SCALARS, st.lists(SCALARS, max_size=2))), default=repr), None
    obj: dict = {}
    if draw(st.booleans()):
        obj["prompt_id"] = draw(st.one_of(st.text(max_size=6), st.integers(), IDS))
    if draw(st.integers(0, 19)):
        obj["prompt"] = draw(st.one_of(*[PROMPT_TEXT] * 8, st.none(), st.integers(), st.lists(st.text(max_size=2))))
    if draw(st.booleans()):
        obj["extra"] = draw(VALUES)
    keys = list(obj)
    order = draw(st.permutations(keys)) if keys else keys
    obj = {k: obj[k] for k in order}
    line = json.dumps(obj, ensure_ascii=draw(st.booleans()), default=repr)
    if kind == "duplicate":
        return line[:-1] + (", " if obj else "") + '"prompt": "again"}', None
    if kind == "truncated":
        return line[: draw(st.integers(0, max(len(line) - 1, 0)))], None
    pid = obj.get("prompt_id")
    well_formed = (  # and free of surrogates: JSON reads an escaped pair as one character, a lone one as none
        isinstance(obj.get("prompt"), str) and utf8(obj["prompt"])
        and (pid is None or (isinstance(pid, str) and utf8(pid)) or (isinstance(pid, int) and not isinstance(pid, bool)))
    )
    return line, ((None if pid is None else str(pid)), obj["prompt"]) if well_formed else None


@st.composite
def prompt_files(draw) -> tuple[str, bytes, list[tuple[str, str]] | None]:
    """(suffix, bytes, the (prompt_id, prompt) rows a correct reader returns when the generator knows them)."""
    kind = draw(st.sampled_from(["jsonl"] * 6 + ["txt"] * 2 + ["binary"]))
    if kind == "binary":
        return draw(st.sampled_from([".jsonl", ".txt"])), draw(st.binary(max_size=120)), None
    sep = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    if kind == "txt":
        lines = draw(st.lists(PROMPT_TEXT, min_size=0, max_size=5))
        text = sep.join(lines) + draw(st.sampled_from(["", sep]))
        expected = None
    else:
        drawn = draw(st.lists(jsonl_line(), min_size=0, max_size=5))
        text = sep.join(line for line, _ in drawn) + draw(st.sampled_from(["", sep]))
        rows = [row for _, row in drawn]
        blank = [not line.strip() for line, _ in drawn]
        expected = None
        if all(r is not None or b for r, b in zip(rows, blank)):
            kept = [r for r in rows if r is not None]
            expected = [(str(i) if pid is None else pid, p) for i, (pid, p) in enumerate(kept)]
    bom = draw(st.sampled_from(["", "", "\ufeff"]))
    encoding = draw(st.sampled_from(["utf-8"] * 6 + ["utf-16", "utf-16-le", "latin-1"]))
    as_utf8 = (bom + text).encode("utf-8", "surrogatepass")  # a raw lone surrogate becomes bytes that are not UTF-8
    try:
        data = as_utf8 if encoding == "utf-8" else (bom + text).encode(encoding)
    except UnicodeEncodeError:
        data = as_utf8
    if data != as_utf8:
        expected = None  # not the UTF-8 the generator's rows assume
    return ".jsonl" if kind == "jsonl" else ".txt", data, expected


def reference_rows(suffix: str, data: bytes) -> list[tuple[str, str]]:
    """What the file says, read independently: JSON per line, or stripped text lines."""
    text = data.decode("utf-8").removeprefix("\ufeff")
    lines = [ln for ln in re.split(r"\r\n|\n|\r", text) if ln.strip()]
    if suffix == ".txt":
        return [(str(i), ln.strip()) for i, ln in enumerate(lines)]
    rows = []
    for i, ln in enumerate(lines):
        obj = json.loads(ln)
        pid = obj.get("prompt_id")
        rows.append((str(i) if pid is None else str(pid), obj["prompt"]))
    return rows


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def loaded_or_refused(path: Path):
    """load_prompts' frame, or None after checking its refusal names the file in one line."""
    try:
        df = load_prompts(path)
    except PromptsError as exc:
        msg = str(exc)
        assert str(path) in msg and "\n" not in msg and "\r" not in msg, msg
        return None
    assert df.columns == ["prompt_id", "prompt"] and df.schema["prompt"] == pl.String == df.schema["prompt_id"]
    assert df.height >= 1 and df["prompt_id"].n_unique() == df.height
    for prompt in df["prompt"]:
        assert prompt.strip() and prompt.encode("utf-8")  # never empty, always storable
    return df


BUGS_FOUND = [  # each was accepted and altered, or crashed with another exception type
    (".jsonl", b'{"prompt": "\\ud800"}\n', None),  # lone surrogate escape stored as '\x00'
    (".jsonl", b'{"prompt_id": [1], "prompt": "a"}\n', None),  # polars InvalidOperationError
    (".jsonl", b'{"prompt_id": {"a": 1}, "prompt": "a"}\n', None),  # id became '{1}'
    (".jsonl", b'{"prompt": "a"}\n{"prompt": 1}\n', None),  # the number became the prompt '1'
    (".jsonl", b'{"prompt": "a", "prompt": "b"}\n', None),  # the first of two keys silently won
    (".txt", "one\u2028two\x0bthree\n".encode(), [("0", "one\u2028two\x0bthree")]),  # split into 3 prompts
    (".txt", b"\xef\xbb\xbf\n", None),  # a BOM alone: polars SchemaError
]


@settings(FUZZ, max_examples=400)
@given(case=prompt_files())
@example(case=BUGS_FOUND[0])
@example(case=BUGS_FOUND[1])
@example(case=BUGS_FOUND[2])
@example(case=BUGS_FOUND[3])
@example(case=BUGS_FOUND[4])
@example(case=BUGS_FOUND[5])
@example(case=BUGS_FOUND[6])
def test_prompt_files_load_exactly_or_are_refused_naming_the_file(case):
    suffix, data, expected = case
    with scratch() as tmp:
        df = loaded_or_refused(write(tmp / f"p{suffix}", data))
        event("refused" if df is None else f"loaded ({'rows known' if expected is not None else 'rows read back'})")
        if df is None:
            return
        assert df.rows() == reference_rows(suffix, data)
        if expected is not None:
            assert df.rows() == expected


@settings(FUZZ, max_examples=150)
@given(case=prompt_files())
@example(case=BUGS_FOUND[0])
@example(case=BUGS_FOUND[1])
@example(case=BUGS_FOUND[6])
# 'word ' x 600 is ~1800 tokens, beyond the tiny model's 512: refused before a run folder (pinned config) exists
@example(case=(".jsonl", ('{"prompt_id": "long", "prompt": "' + "word " * 600 + '"}\n').encode(), None))
def test_train_preflight_passes_a_prompt_file_exactly_when_it_loads(tiny_model_dir, case):
    suffix, data, _ = case
    with scratch() as workdir:
        path = write(workdir / f"p{suffix}", data)
        before = sorted(workdir.iterdir())
        root = workdir.parent / f"{workdir.name}-root"
        try:
            loads = loaded_or_refused(path) is not None
            result, calls = invoke_train(root, tiny_model_dir, f"prompts_path={path}", "batch_size=1", "num_minibatches=1")
            event(f"loads {loads}, exit {result.exit_code}")
            if loads and result.exit_code == 0:
                assert len(calls) == 1, result.output
            elif loads:  # a prompt beyond the tiny model's context, or so huge the memory estimate refuses it
                out = result.output
                assert result.exit_code == 2 and len(out.strip().splitlines()) == 1, out
                assert "this config needs about" in out or (str(path) in out and "exceeds the model context" in out), out
            else:
                out = result.output
                assert result.exit_code == 2 and not calls and "Traceback" not in out, (result.exit_code, out)
                assert len(out.strip().splitlines()) == 1 and str(path) in out, out
            assert not root.exists() and sorted(workdir.iterdir()) == before
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("which", ["prompts_path", "eval_prompts_path"])
def test_a_prompt_beyond_the_model_context_is_refused_before_a_run_folder_exists(tiny_model_dir, which):
    """Found by the flow's rollout (or evaluate) phase, it used to leave a pinned run that had trained nothing."""
    with scratch() as workdir:
        path = write(workdir / "p.jsonl", ('{"prompt_id": "ok", "prompt": "Hi"}\n{"prompt_id": "long", "prompt": "'
                                           + "word " * 600 + '"}\n').encode())
        root = workdir.parent / f"{workdir.name}-root"
        result, calls = invoke_train(root, tiny_model_dir, f"{which}={path}", "eval_size=2", "num_minibatches=1")
        out = check_refusal(result, calls, root, workdir, str(path), inputs=(path,))
        assert f"prompts file {path}: prompt 'long' is" in out and "exceeds the model context of 512 tokens" in out


# ---------------------------------------------------------------- prompts that pass really run

RUNNABLE_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30).filter(lambda s: s.strip())


@st.composite
def runnable_prompt_files(draw) -> tuple[bytes, list[tuple[str, str]]]:
    """A valid JSONL file of 1-5 prompts that fit the tiny model's context, and its (prompt_id, prompt) rows."""
    prompts = draw(st.lists(st.one_of(RUNNABLE_TEXT, st.sampled_from(["a\x00b", " x ", "\r\n\tx", "<|im_end|>", "\u2028!"])),
                            min_size=1, max_size=5))
    ids = draw(st.lists(st.one_of(st.none(), st.text(max_size=4), st.integers(-5, 5)), min_size=len(prompts), max_size=len(prompts)))
    rows = [(str(i) if pid is None else str(pid), p) for i, (pid, p) in enumerate(zip(ids, prompts))]
    assume(len({pid for pid, _ in rows}) == len(rows))
    lines = [json.dumps({"prompt": p} if pid is None else {"prompt_id": pid, "prompt": p}, ensure_ascii=draw(st.booleans()))
             for pid, p in zip(ids, prompts)]
    sep = draw(st.sampled_from(["\n", "\r\n"]))
    text = draw(st.sampled_from(["", "\ufeff"])) + sep.join(lines) + draw(st.sampled_from(["", sep, sep + sep]))
    return text.encode("utf-8"), rows


@pytest.mark.slow
@settings(FUZZ, max_examples=8, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture])
@given(case=runnable_prompt_files())
@example(case=(b'\xef\xbb\xbf{"prompt": "a\\u0000b"}\r\n{"prompt_id": 7, "prompt": "\\ud83d\\ude00 \\u2028 caf\\u00e9"}\n',
               [("0", "a\x00b"), ("7", "\U0001f600 \u2028 caf\xe9")]))
def test_prompts_that_pass_run_an_iteration_and_reach_the_rollouts_table_byte_for_byte(tiny_cfg, case):
    from ppo_core import pipeline

    data, rows = case
    with scratch() as tmp:
        path = write(tmp / "p.jsonl", data)
        assert load_prompts(path).rows() == rows
        cfg = tiny_cfg(prompts_path=path, artifact_root=tmp / "artifacts", batch_size=len(rows), num_minibatches=1,
                       eval_size=0, max_new_tokens=4, ppo_epochs=1)
        pipeline.run(cfg, 1)
        table = pq.read_table(cfg.layout.table(1, "rollouts"))
        got = list(zip(table.column("prompt_id").to_pylist(), table.column("prompt").to_pylist()))
        assert got == rows  # batch_size = every prompt: each once, in the file's order
        assert [p.encode("utf-8") for _, p in got] == [p.encode("utf-8") for _, p in rows]
        assert cfg.layout.completed_iterations() == [0, 1]
