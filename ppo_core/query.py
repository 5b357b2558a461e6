"""DuckDB views over the artifact store: one row per token, partitioned by run/iter.

Views: one per table (``rollouts``, ``sa_pairs``, ``rewards``, ``values``,
``advantages``, ``metrics``, ``eval``), plus ``tokens`` (every per-token column
of one generated token in one row) and the table macro
``state_text(run, iter, rollout_id, t)``: the text of the state before token t
(prompt + response prefix), rebuilt on demand — never stored per row.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from ppo_core.config import artifact_root_problem
from ppo_core.layout import table_glob
from ppo_core.tables import TOKEN_TABLES

VIEW_TABLES = ("rollouts", "sa_pairs", "rewards", "values", "advantages", "metrics", "eval")

_TOKENS = """
CREATE VIEW tokens AS
SELECT s.run, s.iter, s.rollout_id, s.t, s.token_id, s.token,
       s.logprob, s.ref_logprob, s.kl, s.entropy,
       r.score, r.kl_penalty, r.reward,
       a.value, a.td_error, a.advantage, a.whitened_advantage, a."return"
FROM sa_pairs s
JOIN rewards r USING (run, iter, rollout_id, t)
JOIN advantages a USING (run, iter, rollout_id, t)
"""

_STATE_TEXT = """
CREATE MACRO state_text(r, i, rid, tt) AS TABLE
SELECT ro.run, ro.iter, ro.rollout_id, tt AS t,
       ro.prompt AS prompt,
       coalesce((SELECT string_agg(s.token, '' ORDER BY s.t) FROM sa_pairs s
                 WHERE s.run = r AND s.iter = i AND s.rollout_id = rid AND s.t < tt), '') AS response_prefix
FROM rollouts ro WHERE ro.run = r AND ro.iter = i AND ro.rollout_id = rid
"""


def connect(artifact_root: Path, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views over every table found under ``artifact_root``.

    ``run`` and ``iter`` are hive partition columns, so ``WHERE run = 'x' AND
    iter = 3`` reads only that directory's files.
    """
    root = Path(artifact_root)
    problem = artifact_root_problem(root)
    if problem:
        raise ValueError(f"artifact root {root} cannot be queried: {problem}")
    con = duckdb.connect(database)
    present = []
    for name in VIEW_TABLES:
        glob = table_glob(root, name)
        if not any(root.glob(str(glob.relative_to(root)))):
            continue
        pattern = glob.as_posix().replace("'", "''")
        con.execute(
            f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{pattern}', hive_partitioning = true, union_by_name = true, "
            "hive_types = {'run': VARCHAR, 'iter': INTEGER})"
        )
        present.append(name)
    if set(TOKEN_TABLES) <= set(present):
        con.execute(_TOKENS)
    if {"rollouts", "sa_pairs"} <= set(present):
        con.execute(_STATE_TEXT)
    return con
