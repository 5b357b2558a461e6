"""One PPO iteration through the ppo_core phases on the tiny model (no Prefect)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from ppo_core import phases as P
from ppo_core import pipeline
from ppo_core.advantage import to_grid
from ppo_core.query import connect
from ppo_core.runs import write_manifest
from ppo_core.tables import TOKEN_TABLES, read_table


def run_iteration(cfg, it: int) -> dict[str, P.PhaseResult]:
    """One iteration through the pipeline's own wiring, its results by phase."""
    return {r["phase"]: P.PhaseResult(**r) for r in pipeline.run_iteration(cfg, it)}


def token_tables_consistent(layout, iteration: int) -> bool:
    """The three token tables have exactly one row per generated token."""
    ro = read_table(layout.table(iteration, "rollouts"))
    n = sum(len(r) for r in ro.column("response_token_ids").to_pylist())
    return all(pq.read_metadata(layout.table(iteration, t)).num_rows == n for t in TOKEN_TABLES)


@pytest.fixture
def one_iteration(tiny_cfg):
    cfg = tiny_cfg(reward="length", length_min=2, length_max=4, kl_coef=0.1)
    P.init_checkpoint(cfg)
    return cfg, run_iteration(cfg, 1)


def _frame(cfg, it, name) -> pl.DataFrame:
    return pl.from_arrow(read_table(cfg.layout.table(it, name)))


def test_token_tables_have_one_row_per_generated_token(one_iteration):
    cfg, _ = one_iteration
    ro = _frame(cfg, 1, "rollouts")
    n_tokens = int(ro["response_token_ids"].list.len().sum())
    assert ro.height == cfg.batch_size
    for name in ("sa_pairs", "rewards", "values", "advantages"):
        df = _frame(cfg, 1, name)
        assert df.height == n_tokens, name
        assert df.select("rollout_id", "t").is_duplicated().sum() == 0
    assert token_tables_consistent(cfg.layout, 1)


def test_first_iteration_policy_equals_reference(one_iteration):
    cfg, _ = one_iteration
    sa = _frame(cfg, 1, "sa_pairs")
    assert sa["kl"].abs().max() == 0.0
    ro = _frame(cfg, 1, "rollouts")
    sampled = np.concatenate(ro["sampling_logprobs"].to_list())
    np.testing.assert_allclose(sa["logprob"].to_numpy(), sampled, atol=2e-4)


def test_rewards_sum_to_score_minus_beta_kl(one_iteration):
    cfg, _ = one_iteration
    rw = _frame(cfg, 1, "rewards")
    sa = _frame(cfg, 1, "sa_pairs")
    per = rw.join(sa, on=["rollout_id", "t"]).group_by("rollout_id").agg(
        pl.col("reward").sum(), pl.col("score").sum(), pl.col("kl").sum(), (pl.col("score") != 0).sum().alias("nz"),
        pl.col("t").max().alias("last"), pl.col("score").last().alias("last_score"),
    )
    np.testing.assert_allclose(per["reward"], per["score"] - cfg.kl_coef * per["kl"], atol=1e-5)
    assert (per["nz"] <= 1).all()
    np.testing.assert_allclose(per["last_score"], per["score"], atol=1e-6)


def test_advantages_match_independent_gae(one_iteration):
    cfg, _ = one_iteration
    df = _frame(cfg, 1, "rewards").join(_frame(cfg, 1, "advantages"), on=["rollout_id", "t"]).sort("rollout_id", "t")
    lengths = df.group_by("rollout_id", maintain_order=True).len()["len"].to_numpy()
    r, mask = to_grid(df["reward"].to_numpy(), lengths)
    v, _ = to_grid(df["value"].to_numpy(), lengths)
    adv = np.zeros_like(r)
    last = np.zeros(len(lengths))
    for t in reversed(range(r.shape[1])):  # plain reference recursion
        nv = v[:, t + 1] if t + 1 < r.shape[1] else 0.0
        delta = r[:, t] + cfg.gamma * nv - v[:, t]
        last = np.where(mask[:, t], delta + cfg.gamma * cfg.lam * last, 0.0)
        adv[:, t] = last
    np.testing.assert_allclose(df["advantage"].to_numpy(), adv[mask], atol=1e-5)
    np.testing.assert_allclose(df["return"].to_numpy(), adv[mask] + v[mask], atol=1e-5)
    w = df["whitened_advantage"].to_numpy()
    assert abs(w.mean()) < 1e-5 and abs(w.std() - 1) < 1e-3


def test_train_moves_policy_and_writes_metrics(one_iteration):
    cfg, res = one_iteration
    m = _frame(cfg, 1, "metrics")
    assert m.height == cfg.ppo_epochs * cfg.num_minibatches
    assert np.isfinite(m.select(pl.exclude("step", "epoch", "minibatch", "entropy")).to_numpy()).all()
    assert m["entropy"].is_nan().all()  # not computed without an entropy bonus (attribute reports it)
    # first minibatch of the first epoch is on-policy: ratio == 1, nothing clipped
    assert m["approx_kl"][0] < 1e-6 and m["clip_fraction"][0] == 0.0
    from safetensors.numpy import load_file

    before = load_file(cfg.layout.checkpoint(0).adapter("policy"))
    after = load_file(cfg.layout.checkpoint(1).adapter("policy"))
    assert before.keys() == after.keys()
    assert any(not np.array_equal(before[k], after[k]) for k in before if k.endswith(".b"))
    # the next iteration samples with the trained policy: KL to the reference is no longer zero
    cfg2 = cfg
    ck = cfg2.layout.checkpoint(1)
    ro2 = P.rollout(cfg2, 2, ck)
    sa2 = P.attribute(cfg2, 2, ro2.path("rollouts"), ck)
    assert np.abs(read_table(sa2.path("sa_pairs")).column("kl").to_numpy()).max() > 0


def test_rerun_reuses_every_phase_and_recomputes_damaged_outputs(one_iteration):
    cfg, first = one_iteration
    again = run_iteration(cfg, 1)
    assert all(r.cached for r in again.values())
    assert {k: r.hashes for k, r in again.items()} == {k: r.hashes for k, r in first.items()}
    # damage one table and delete another: both are detected and recomputed to identical bytes
    adv = cfg.layout.table(1, "advantages")
    adv.write_bytes(adv.read_bytes()[:-20])
    (cfg.layout.table(1, "eval")).unlink()
    third = run_iteration(cfg, 1)
    assert not third["advantage"].cached and not third["evaluate"].cached
    assert third["rollout"].cached and third["train"].cached
    assert third["advantage"].hashes == first["advantage"].hashes
    assert third["evaluate"].hashes == first["evaluate"].hashes

    # one flipped byte: in a table (its hash), in a phase record (invalid UTF-8, or a digit of a recorded hash)
    sa = cfg.layout.table(1, "sa_pairs")
    data = bytearray(sa.read_bytes())
    data[len(data) // 2] ^= 0x01
    sa.write_bytes(bytes(data))
    record = cfg.layout.phase_record(1, "reward")
    record.write_bytes(record.read_bytes().replace(b'"reward"', b'"rew\xffrd"', 1))
    value_record = cfg.layout.phase_record(1, "value")
    text = value_record.read_text()
    digest = json.loads(text)["hashes"]["values"]
    value_record.write_text(text.replace(digest, ("0" if digest[0] != "0" else "1") + digest[1:]))
    fourth = run_iteration(cfg, 1)
    assert not fourth["attribute"].cached and not fourth["reward"].cached and not fourth["value"].cached
    assert fourth["rollout"].cached
    for phase in ("attribute", "reward", "value"):
        assert fourth[phase].hashes == first[phase].hashes, phase


def test_same_seed_same_bytes_in_a_fresh_run(one_iteration, tiny_cfg, tmp_path):
    cfg, first = one_iteration
    other = tiny_cfg(reward="length", length_min=2, length_max=4, kl_coef=0.1, artifact_root=tmp_path / "other")
    P.init_checkpoint(other)
    second = run_iteration(other, 1)
    for phase in first:
        assert first[phase].hashes == second[phase].hashes, phase


def test_manifest_and_sql_views(one_iteration):
    cfg, res = one_iteration
    path = write_manifest(cfg, 1, [r.to_json() for r in res.values()])
    manifest = json.loads(path.read_text())
    assert manifest["config_hash"] == cfg.training_hash()
    assert "iter=0001/rollouts.parquet" in manifest["artifacts"]
    assert "iter=0001/checkpoint/policy_adapter.safetensors" in manifest["artifacts"]
    con = connect(cfg.artifact_root)
    rows = con.sql("select run, iter, count(*) as n, avg(advantage) from advantages group by 1, 2").fetchall()
    n_tokens = _frame(cfg, 1, "advantages").height
    assert rows[0][:3] == ("default", 1, n_tokens)
