"""Benchmark: DuckDB queries of docs/queries.md over a large synthetic artifact store.

Writes ``--iterations`` x ``--tokens`` random token rows (default 50 x 100k = 5M)
of sa_pairs, rewards and advantages (and their rollouts) for run 'x' with ``write_table`` into a
temporary directory (vectorised NumPy/PyArrow, no per-token Python), then times
each query (median of ``--repeat`` runs, plus the first run) and prints JSON.
Usage: python bench/bench_query.py [--iterations 50] [--tokens 100000] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ppo_core.layout import RunLayout
from ppo_core.query import connect
from ppo_core.tables import write_table

RUN = "x"
VOCAB = pa.array([f" tok{i}" for i in range(5000)] + ["\n", "!", ".", ","])

QUERIES = {
    # (a) of docs/queries.md, one iteration: a 3-way join of the tokens view, pruned to 3 files
    "top_tokens_iter17": f"""
        select token, count(*) as n, avg(advantage) as mean_advantage,
               avg(whitened_advantage) as mean_whitened_advantage
        from tokens where run = '{RUN}' and iter = 17
        group by token having count(*) >= 5
        order by mean_advantage desc, token limit 20""",
    # (b), one iteration
    "kl_by_position_iter17": f"""
        select run, t, count(*) as n, avg(kl) as mean_kl, avg(abs(kl)) as mean_abs_kl, max(kl) as max_kl
        from sa_pairs where run = '{RUN}' and iter = 17
        group by run, t order by run, t""",
    # (i): full scan of one column of every iteration
    "avg_advantage_by_iter_full_scan": "select iter, avg(advantage) from advantages group by 1",
    # (a) over the whole run: the 3-way join of all rows
    "top_tokens_all_iters": f"""
        select token, count(*) as n, avg(advantage) as mean_advantage,
               avg(whitened_advantage) as mean_whitened_advantage
        from tokens where run = '{RUN}'
        group by token having count(*) >= 5
        order by mean_advantage desc, token limit 20""",
}


def token_rows(rng: np.random.Generator, n: int, mean_len: int = 128) -> dict[str, pa.Array | np.ndarray]:
    """n token rows of random rollouts (rollout-major, t = 0..len-1), all columns vectorised."""
    n_rollouts = max(1, n // mean_len)
    cuts = np.sort(rng.choice(np.arange(1, n), n_rollouts - 1, replace=False)) if n_rollouts > 1 else np.array([], int)
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [n]]))
    rollout_id = np.repeat(np.arange(n_rollouts, dtype=np.int32), lengths)
    t = (np.arange(n) - np.repeat(starts, lengths)).astype(np.int32)
    token_id = rng.integers(0, len(VOCAB), n).astype(np.int32)
    logprob = -rng.exponential(1.0, n).astype(np.float32)
    ref_logprob = (logprob + rng.normal(0, 0.3, n)).astype(np.float32)
    kl = logprob - ref_logprob
    score = np.zeros(n, np.float32)
    score[np.cumsum(lengths) - 1] = rng.normal(0, 1, n_rollouts)
    value = rng.normal(0, 1, n).astype(np.float32)
    advantage = rng.normal(0, 1, n).astype(np.float32)
    return {
        "rollout_id": rollout_id, "t": t, "token_id": token_id, "token": pc.take(VOCAB, pa.array(token_id)),
        "logprob": logprob, "ref_logprob": ref_logprob, "kl": kl, "entropy": rng.uniform(0, 3, n).astype(np.float32),
        "score": score, "kl_penalty": -0.05 * kl, "reward": score - 0.05 * kl,
        "value": value, "td_error": rng.normal(0, 1, n).astype(np.float32), "advantage": advantage,
        "whitened_advantage": (advantage - advantage.mean()) / advantage.std(), "return": advantage + value,
    }  # fmt: skip


def rollout_rows(cols: dict[str, pa.Array | np.ndarray], iteration: int) -> dict[str, pa.Array | np.ndarray]:
    """The rollouts table of ``token_rows``' tokens: one row per rollout, built from list offsets."""
    lengths = np.bincount(cols["rollout_id"])
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    n = len(lengths)
    prompt_ids = pa.ListArray.from_arrays(pa.array(np.arange(0, 8 * n + 1, 8, dtype=np.int32)), pa.array(np.zeros(8 * n, np.int32)))
    return {
        "rollout_id": np.arange(n, dtype=np.int32),
        "prompt_id": pc.binary_join_element_wise("p-", pa.array(np.arange(n).astype(str)), ""),
        "prompt": pa.array(["Tell me something nice."] * n),
        "response": pc.binary_join(pa.ListArray.from_arrays(offsets, cols["token"]), ""),
        "prompt_token_ids": prompt_ids,
        "response_token_ids": pa.ListArray.from_arrays(offsets, pa.array(cols["token_id"])),
        "finish_reason": pa.array(["eos"] * n),
        "sampling_logprobs": pa.ListArray.from_arrays(offsets, pa.array(cols["logprob"])),
        "seed": np.full(n, iteration, dtype=np.int64),
    }


def build(root: Path, iterations: int, tokens: int, seed: int = 0) -> int:
    """Iterations 1..N of run 'x': the four experience tables and a manifest each (so reports count them done)."""
    rng = np.random.default_rng(seed)
    for it in range(1, iterations + 1):
        cols = token_rows(rng, tokens)
        layout = RunLayout(root, RUN)
        iter_dir = layout.iter_dir(it)
        for name in ("sa_pairs", "rewards", "advantages"):
            write_table(iter_dir, name, cols)  # write_table keeps only the table's own columns
        write_table(iter_dir, "rollouts", rollout_rows(cols, it))
        layout.manifest(it).write_text(json.dumps({"run": RUN, "iteration": it}))
    return iterations * tokens


def store_arguments(description: str, repeat: int) -> argparse.ArgumentParser:
    """The options every benchmark over the synthetic store shares."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=100_000, help="token rows per iteration")
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--root", type=Path, default=None, help="reuse/keep the store here instead of a temp dir")
    return ap


@contextlib.contextmanager
def synthetic_store(root: Path | None, iterations: int, tokens: int) -> Iterator[tuple[Path, float]]:
    """(store root, seconds spent building it); a temporary store is deleted afterwards, a given one kept."""
    path = root or Path(tempfile.mkdtemp(prefix="ppo-bench-store-"))
    try:
        t0 = time.perf_counter()
        if not RunLayout(path, RUN).has_table("rollouts"):
            build(path, iterations, tokens)
        yield path, time.perf_counter() - t0
    finally:
        if root is None:
            shutil.rmtree(path, ignore_errors=True)


def timed(fn: Callable[[], object], repeat: int, digits: int = 4) -> dict[str, float]:
    """The first call (cold file cache and metadata) apart, and the median of ``repeat`` more."""
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"first_s": round(times[0], digits), "median_s": round(statistics.median(times[1:]), digits)}


def main() -> None:
    ap = store_arguments(__doc__.splitlines()[0], repeat=5)
    ap.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: DuckDB's)")
    args = ap.parse_args()
    with synthetic_store(args.root, args.iterations, args.tokens) as (root, build_s):
        con = connect(root)
        if args.threads:
            con.execute(f"set threads = {args.threads}")
        rows = con.sql("select count(*) from sa_pairs").fetchall()[0][0]
        results = {name: timed(lambda q=q: con.sql(q).fetchall(), args.repeat) for name, q in QUERIES.items()}
        out = {
            "token_rows": rows,
            "iterations": args.iterations,
            "tokens_per_iteration": args.tokens,
            "build_s": round(build_s, 1),
            "disk_mb": round(sum(p.stat().st_size for p in root.rglob("*.parquet")) / 2**20, 1),
            "threads": con.sql("select current_setting('threads')").fetchall()[0][0],
            "repeat": args.repeat,
            "queries": results,
        }
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
