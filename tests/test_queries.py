"""Every query of docs/queries.md, checked against an independent Polars/NumPy answer.

The SQL is read from the ```sql blocks of docs/queries.md in order, so the doc and
these checks cannot drift apart. The data is the synthetic artifact store
of ``tests/synthetic_store.py`` (2 runs x 3 iterations x 20 rollouts of 1..12 tokens).
"""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from ppo_core.layout import table_glob
from ppo_core.query import connect
from synthetic_store import TRACKED_PROMPT, VOCAB, build_store

DOC = Path(__file__).resolve().parents[1] / "docs" / "queries.md"


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


SQL_BLOCKS = doc_blocks("sql")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("query-store") / "artifacts"
    data = build_store(root)
    return root, data, connect(root)


# --------------------------------------------------------------------------- helpers

F64 = pl.Float64


def _mean(col: str) -> pl.Expr:
    return pl.col(col).cast(F64).mean()


def assert_same(got: pl.DataFrame, expected: pl.DataFrame, sort_by: list[str] | None = None) -> None:
    """Same columns (names, order), same rows; numbers to 1e-6 relative, types ignored."""
    assert got.columns == expected.columns
    if sort_by:
        got, expected = got.sort(sort_by), expected.sort(sort_by)
    assert got.height == expected.height
    assert_frame_equal(got, expected, check_dtypes=False, rel_tol=1e-6, abs_tol=1e-9)


# --------------------------------------------------------------------------- expected answers, in doc order


def exp_top_tokens(data):
    tok = data["tokens"].filter(pl.col("run") == "default")
    return (
        tok.group_by("token")
        .agg(n=pl.len(), mean_advantage=_mean("advantage"), mean_whitened_advantage=_mean("whitened_advantage"))
        .filter(pl.col("n") >= 5)
        .sort(["mean_advantage", "token"], descending=[True, False])
        .head(20)
    )


def exp_kl_by_position(data):
    return (
        data["tokens"].group_by("run", "t")
        .agg(n=pl.len(), mean_kl=_mean("kl"), mean_abs_kl=pl.col("kl").abs().cast(F64).mean(),
             max_kl=pl.col("kl").max())
        .sort("run", "t")
    )  # fmt: skip


def exp_score_vs_length(data):
    return (
        data["rollouts"].group_by("run", pl.col("length").alias("response_length"))
        .agg(rollouts=pl.len(), mean_score=_mean("score"), min_score=pl.col("score").min(),
             max_score=pl.col("score").max())
        .sort("run", "response_length")
    )  # fmt: skip


def exp_score_length_corr(data):
    rows = []
    for (run, it), g in data["rollouts"].group_by("run", "iter"):
        x, y = g["length"].to_numpy().astype(float), g["score"].to_numpy().astype(float)
        slope = np.polyfit(x, y, 1)[0]
        rows.append({"run": run, "iter": it, "rollouts": g.height,
                     "corr_score_length": float(np.corrcoef(x, y)[0, 1]), "score_per_token": float(slope)})  # fmt: skip
    return pl.DataFrame(rows).sort("run", "iter")


def exp_sign_flips(data):
    rows = []
    for (run, it, rid), g in data["tokens"].sort("t").group_by("run", "iter", "rollout_id"):
        s = np.sign(g["advantage"].to_numpy())
        changes = int(np.sum(s[1:] * s[:-1] < 0))
        if changes:
            rows.append({"run": run, "iter": it, "rollout_id": rid, "response_length": g.height, "sign_changes": changes})
    return pl.DataFrame(rows).sort(["sign_changes", "run", "iter", "rollout_id"], descending=[True, False, False, False]).head(50)


def exp_prompt_drift(data):
    ro = data["rollouts"].filter(pl.col("prompt_id") == TRACKED_PROMPT).sort("run", "iter", "rollout_id")
    return ro.select(
        "run", "iter", "rollout_id",
        pl.col("length").alias("response_length"),
        "finish_reason", "score",
        (pl.col("score") - pl.col("score").shift(1).over("run")).alias("score_change"),
        pl.col("response").map_elements(lambda s: " ".join(s.split()[:6]), return_dtype=pl.String).alias("first_words"),
    )  # fmt: skip


def exp_value_error(data):
    err = pl.col("return") - pl.col("value")  # float32 arithmetic, as in DuckDB
    return (
        data["tokens"].group_by("run", "t")
        .agg(n=pl.len(), mean_error=err.cast(F64).mean(), mean_abs_error=err.abs().cast(F64).mean(),
             rmse=(err.cast(F64) * err.cast(F64)).mean().sqrt())  # fmt: skip
        .sort("run", "t")
    )


def exp_policy_ref_gap(data):
    tok = data["tokens"].filter(pl.col("run") == "default")
    gap = np.abs(tok["logprob"].to_numpy() - tok["ref_logprob"].to_numpy())  # float32, as stored
    top = (
        tok.with_columns(gap=pl.Series(gap))
        .sort(["gap", "iter", "rollout_id", "t"], descending=[True, False, False, False])
        .head(10)
    )
    # the state before token t, rebuilt here from the generated lists (not from SQL)
    ro = data["rollouts"].filter(pl.col("run") == "default")
    lookup = {(r["iter"], r["rollout_id"]): r for r in ro.iter_rows(named=True)}
    states = []
    for r in top.iter_rows(named=True):
        rollout = lookup[(r["iter"], r["rollout_id"])]
        prefix = "".join(VOCAB[i] for i in rollout["response_token_ids"][: r["t"]])
        states.append(rollout["prompt"] + prefix)
    return top.select("run", "iter", "rollout_id", "t", "token", "logprob", "ref_logprob", "gap").with_columns(
        state=pl.Series(states)
    )


def exp_clip_fraction(data):
    m = data["metrics"]
    last = m.group_by("run", "iter").agg(last_epoch=pl.col("epoch").max())
    return (
        m.join(last, on=["run", "iter"])
        .group_by("run", "iter")
        .agg(steps=pl.len(), mean_clip_fraction=_mean("clip_fraction"), max_clip_fraction=pl.col("clip_fraction").max(),
             last_epoch_clip_fraction=pl.col("clip_fraction").filter(pl.col("epoch") == pl.col("last_epoch")).cast(F64).mean(),
             mean_value_clip_fraction=_mean("value_clip_fraction"), mean_approx_kl=_mean("approx_kl"))
        .sort("run", "iter")
    )  # fmt: skip


def exp_adv_by_iter_pooled(data):
    return data["tokens"].group_by("iter").agg(_mean("advantage").alias("avg(advantage)"))


def exp_adv_by_run_iter(data):
    return data["tokens"].group_by("run", "iter").agg(tokens=pl.len(), mean_advantage=_mean("advantage")).sort("run", "iter")


# (checker name, a phrase its SQL must contain, expected-frame builder, columns to sort by before comparing)
CHECKS = [
    ("top_tokens", "avg(advantage) as mean_advantage", exp_top_tokens, None),
    ("kl_by_position", "avg(kl) as mean_kl", exp_kl_by_position, None),
    ("score_vs_length", "len(ro.response_token_ids) as response_length", exp_score_vs_length, None),
    ("score_length_corr", "corr(score, response_length)", exp_score_length_corr, None),
    ("sign_flips", "sign_changes", exp_sign_flips, None),
    ("prompt_drift", "prompt_id =", exp_prompt_drift, None),
    ("value_error", "rmse", exp_value_error, None),
    ("policy_ref_gap", "state_text(", exp_policy_ref_gap, None),
    ("clip_fraction", "clip_fraction", exp_clip_fraction, None),
    ("adv_by_iter_pooled", "select iter, avg(advantage) from advantages group by 1", exp_adv_by_iter_pooled, ["iter"]),
    ("adv_by_run_iter", "mean_advantage", exp_adv_by_run_iter, None),
    ("explain_pruning", "explain analyze", None, None),
]


def test_doc_has_one_check_per_query():
    assert len(SQL_BLOCKS) == len(CHECKS), "docs/queries.md and CHECKS disagree on the number of ```sql blocks"
    for sql, (name, phrase, _, _) in zip(SQL_BLOCKS, CHECKS):
        assert phrase in sql, f"query {name}: expected {phrase!r} in\n{sql}"
        assert '"' not in sql and "$" not in sql and "!" not in sql, f"query {name} breaks ppo sql \"...\" quoting"


@pytest.mark.parametrize("index", range(len(CHECKS)), ids=[c[0] for c in CHECKS])
def test_doc_query(store, index):
    root, data, con = store
    name, _, expected_fn, sort_by = CHECKS[index]
    sql = SQL_BLOCKS[index]
    if expected_fn is None:  # explain analyze: one file per scan of the tokens view
        plan = "\n".join(str(v) for row in con.sql(sql).fetchall() for v in row)
        total_files = len(list(root.glob(str(table_glob(root, "sa_pairs").relative_to(root)))))
        assert plan.count(f"Scanning Files: 1/{total_files}") == 3, plan
        assert re.findall(r"Total Files Read: (\d+)", plan) == ["1", "1", "1"], plan
        return
    got = con.sql(sql).pl()
    expected = expected_fn(data)
    assert expected.height > 0, f"{name}: the synthetic data does not exercise this query"
    assert_same(got, expected, sort_by)


def test_python_snippet_runs(store):
    root, data, _ = store
    (snippet,) = [b for b in doc_blocks("python") if "connect(" in b]
    ns = {"root": root}
    exec(snippet, ns)
    assert_same(ns["df"], exp_adv_by_run_iter(data).select("run", "iter", "mean_advantage"))


# --------------------------------------------------------------------------- views and macro


def test_tokens_view_one_row_per_generated_token(store):
    _, data, con = store
    got = con.sql("select run, iter, rollout_id, t, token, advantage, reward from tokens").pl()
    n_generated = int(data["rollouts"]["response_token_ids"].list.len().sum())
    assert got.height == n_generated == data["tokens"].height
    assert got.select("run", "iter", "rollout_id", "t").is_duplicated().sum() == 0
    key = ["run", "iter", "rollout_id", "t"]
    cols = key + ["token", "advantage", "reward"]
    assert_same(got.select(cols), data["tokens"].select(cols), sort_by=key)
    # per rollout: t runs 0..len-1 and matches response_token_ids' length
    per = got.group_by("run", "iter", "rollout_id").agg(n=pl.len(), t_min=pl.col("t").min(), t_max=pl.col("t").max())
    lens = data["rollouts"].select("run", "iter", "rollout_id", "length")
    joined = per.join(lens, on=["run", "iter", "rollout_id"], how="full", coalesce=True)
    assert joined.height == data["rollouts"].height
    assert (joined["n"] == joined["length"]).all() and (joined["t_min"] == 0).all()
    assert (joined["t_max"] == joined["length"] - 1).all()


def test_state_text_is_prompt_plus_previous_tokens(store):
    _, data, con = store
    got = con.sql(
        """select tk.run, tk.iter, tk.rollout_id, tk.t, st.t as st_t, st.prompt, st.response_prefix
           from sa_pairs tk, state_text(tk.run, tk.iter, tk.rollout_id, tk.t) st"""
    ).pl()
    assert got.height == data["tokens"].height
    assert (got["t"] == got["st_t"]).all()
    ro = {(r["run"], r["iter"], r["rollout_id"]): r for r in data["rollouts"].iter_rows(named=True)}
    for r in got.iter_rows(named=True):
        rollout = ro[(r["run"], r["iter"], r["rollout_id"])]
        assert r["prompt"] == rollout["prompt"]
        assert r["response_prefix"] == "".join(VOCAB[i] for i in rollout["response_token_ids"][: r["t"]])
    # t = 0 is the bare prompt; t = length is the whole response
    run, it, rid = "sunny", 2, 3
    rollout = ro[(run, it, rid)]
    (row0,) = con.sql(f"select prompt || response_prefix from state_text('{run}', {it}, {rid}, 0)").fetchall()
    assert row0[0] == rollout["prompt"]
    (row_end,) = con.sql(f"select response_prefix from state_text('{run}', {it}, {rid}, {rollout['length']})").fetchall()
    assert row_end[0] == rollout["response"]
