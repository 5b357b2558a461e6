"""Every query of docs/queries.md, checked against an independent Polars/NumPy answer.

The SQL is read from the ```sql blocks of docs/queries.md in order, so the doc and
these checks cannot drift apart. The data is a synthetic artifact store
(2 runs x 3 iterations x 20 rollouts of 1..12 tokens) written with ``write_table``.
"""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from ppo_core.advantage import gae
from ppo_core.query import connect
from ppo_core.tables import write_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "queries.md"
RUNS = ("default", "sunny")
ITERS = (1, 2, 3)
N_ROLLOUTS = 20
N_PROMPTS = 30
MAX_LEN = 12
KL_COEF = 0.05
GAMMA, LAM = 1.0, 0.95
EPOCHS, MINIBATCHES = 2, 2
TRACKED_PROMPT = "train-0007"  # the prompt of query (e); sampled in every iteration
COMMON = [
    " the", " cat", " sat", " on", " mat", " and", " then", " it", " was", " happy",
    "!", ".", ",", " a", " dog", " ran",
]  # fmt: skip
# rare tokens, placed exactly RARE_PER_ITER[k][iter - 1] times per iteration in every run:
# 1, 4, 5, 6 and 9 occurrences per run, around query (a)'s "having count(*) >= 5"; with the
# 16 common tokens that leaves 19 eligible tokens, fewer than its "limit 20"
RARE = [" über", " naïve", "\n", " 42", " very"]
RARE_PER_ITER = [(0, 0, 1), (1, 1, 2), (2, 1, 2), (2, 2, 2), (3, 3, 3)]
VOCAB = COMMON + RARE


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


SQL_BLOCKS = doc_blocks("sql")


# --------------------------------------------------------------------------- data


def _build_store(root: Path) -> dict[str, pl.DataFrame]:
    """Write the store; return the same data as Polars frames (with run/iter) for the checks."""
    rng = np.random.default_rng(20240607)
    prompts = [f"Prompt {k}: tell me about thing {k}." for k in range(N_PROMPTS)]
    tracked = int(TRACKED_PROMPT.removeprefix("train-"))
    ro_frames, tok_frames, met_frames = [], [], []
    for run in RUNS:
        # an evaluation-only iteration 0, as the pipeline writes it (no token tables there)
        write_table(
            root / f"run={run}" / "iter=0000",
            "eval",
            {"prompt_id": ["eval-0000"], "prompt": ["p"], "response": ["r"], "response_tokens": [1],
             "finish_reason": ["eos"], "score": [0.5]},
        )  # fmt: skip
        for it in ITERS:
            iter_dir = root / f"run={run}" / f"iter={it:04d}"
            others = rng.choice(np.setdiff1d(np.arange(N_PROMPTS), [tracked]), N_ROLLOUTS - 1, replace=False)
            chosen = np.sort(np.append(others, tracked))
            lengths = rng.integers(1, MAX_LEN + 1, N_ROLLOUTS)
            n = int(lengths.sum())
            rid = np.repeat(np.arange(N_ROLLOUTS, dtype=np.int32), lengths)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            t = (np.arange(n) - np.repeat(starts, lengths)).astype(np.int32)
            ends = np.cumsum(lengths) - 1
            token_id = rng.integers(0, len(COMMON), n).astype(np.int32)
            rare_ids = np.repeat(len(COMMON) + np.arange(len(RARE)), [c[it - 1] for c in RARE_PER_ITER])
            token_id[rng.choice(n, len(rare_ids), replace=False)] = rare_ids
            token = np.array(VOCAB, dtype=object)[token_id]
            ids_per = np.split(token_id, ends[:-1] + 1)
            responses = ["".join(VOCAB[i] for i in ids) for ids in ids_per]

            rollouts = {
                "rollout_id": np.arange(N_ROLLOUTS, dtype=np.int32),
                "prompt_id": [f"train-{k:04d}" for k in chosen],
                "prompt": [prompts[k] for k in chosen],
                "response": responses,
                "prompt_token_ids": [rng.integers(0, 1000, 5).tolist() for _ in chosen],
                "response_token_ids": [ids.tolist() for ids in ids_per],
                "finish_reason": ["length" if L == MAX_LEN else "eos" for L in lengths],
                "sampling_logprobs": [(-rng.exponential(1.0, L)).tolist() for L in lengths],
                "seed": [1000 * it] * N_ROLLOUTS,
            }
            write_table(iter_dir, "rollouts", rollouts)

            logprob = (-rng.exponential(1.0, n)).astype(np.float32)
            ref_logprob = (logprob + rng.normal(0.0, 0.4, n)).astype(np.float32)
            kl = logprob - ref_logprob  # float32, exactly as stored
            sa = {
                "rollout_id": rid, "t": t, "token_id": token_id, "token": token.tolist(),
                "logprob": logprob, "ref_logprob": ref_logprob, "kl": kl,
                "entropy": rng.uniform(0.0, 3.0, n).astype(np.float32),
            }  # fmt: skip
            write_table(iter_dir, "sa_pairs", sa)

            scores = rng.normal(0.0, 1.0, N_ROLLOUTS)
            score_t = np.zeros(n)
            score_t[ends] = scores
            penalty = -KL_COEF * kl.astype(np.float64)
            reward = score_t + penalty
            write_table(iter_dir, "rewards", {"rollout_id": rid, "t": t, "score": score_t,
                                              "kl_penalty": penalty, "reward": reward})  # fmt: skip

            value = rng.normal(0.0, 1.0, n).astype(np.float32)
            write_table(iter_dir, "values", {"rollout_id": rid, "t": t, "value": value})
            adv = gae(reward.astype(np.float32).astype(np.float64), value.astype(np.float64), lengths, GAMMA, LAM)
            advantages = {
                "rollout_id": rid, "t": t, "value": value, "td_error": adv.td_error,
                "advantage": adv.advantage, "whitened_advantage": adv.whitened, "return": adv.returns,
            }  # fmt: skip
            write_table(iter_dir, "advantages", advantages)

            steps = EPOCHS * MINIBATCHES
            base = (RUNS.index(run) * len(ITERS) + it - 1) * steps
            metrics = {
                "step": np.arange(steps), "epoch": np.repeat(np.arange(EPOCHS), MINIBATCHES),
                "minibatch": np.tile(np.arange(MINIBATCHES), EPOCHS),
                "policy_loss": rng.normal(size=steps), "value_loss": rng.uniform(size=steps),
                "entropy": rng.uniform(size=steps), "approx_kl": rng.uniform(0, 0.1, steps),
                # known values, exact in float32: 0/64, 1/64, ... unique per (run, iter, step)
                "clip_fraction": (base + np.arange(steps)) / 64.0,
                "value_clip_fraction": (base + np.arange(steps)) / 128.0,
                "policy_grad_norm": rng.uniform(size=steps), "value_grad_norm": rng.uniform(size=steps),
            }  # fmt: skip
            write_table(iter_dir, "metrics", metrics)

            # the frames the checks use (float32 columns kept float32, like the files)
            part = {"run": run, "iter": it}
            ro_frames.append(
                pl.DataFrame({k: v for k, v in rollouts.items() if k != "sampling_logprobs"})
                .with_columns(length=pl.Series(lengths, dtype=pl.Int64), score=pl.Series(scores, dtype=pl.Float32),
                              **{k: pl.lit(v) for k, v in part.items()})
            )  # fmt: skip
            tok_frames.append(
                pl.DataFrame({
                    "rollout_id": rid, "t": t, "token": token.tolist(), "logprob": logprob,
                    "ref_logprob": ref_logprob, "kl": kl,
                    "score": score_t.astype(np.float32), "reward": reward.astype(np.float32),
                    "value": value, "advantage": adv.advantage.astype(np.float32),
                    "whitened_advantage": adv.whitened.astype(np.float32),
                    "return": adv.returns.astype(np.float32),
                }).with_columns(**{k: pl.lit(v) for k, v in part.items()})
            )  # fmt: skip
            met_frames.append(
                pl.DataFrame({k: metrics[k] for k in ("epoch", "clip_fraction", "value_clip_fraction", "approx_kl")})
                .with_columns(pl.col("clip_fraction", "value_clip_fraction", "approx_kl").cast(pl.Float32),
                              **{k: pl.lit(v) for k, v in part.items()})
            )  # fmt: skip
    return {"rollouts": pl.concat(ro_frames), "tokens": pl.concat(tok_frames), "metrics": pl.concat(met_frames)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("query-store") / "artifacts"
    data = _build_store(root)
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
        total_files = len(list(root.glob("run=*/iter=*/sa_pairs.parquet")))
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
