"""DuckDB views over the artifact store: one row per token, partitioned by run/iter."""

from __future__ import annotations

from pathlib import Path

import duckdb

VIEW_TABLES = ("rollouts", "sa_pairs", "rewards", "values", "advantages", "metrics", "eval")


def connect(artifact_root: Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with a view per table that exists under ``artifact_root``.

    ``run`` and ``iter`` are hive partition columns, so ``WHERE run = 'x' AND
    iter = 3`` reads one directory's files only.
    """
    con = duckdb.connect(":memory:")
    root = Path(artifact_root)
    for name in VIEW_TABLES:
        pattern = root / "run=*" / "iter=*" / f"{name}.parquet"
        if not any(root.glob(f"run=*/iter=*/{name}.parquet")):
            continue
        con.execute(
            f"CREATE VIEW {name} AS SELECT * FROM read_parquet("
            f"'{pattern.as_posix()}', hive_partitioning = true, hive_types = {{'run': VARCHAR, 'iter': INTEGER}})"
        )
    return con


def sql(artifact_root: Path, query: str) -> duckdb.DuckDBPyRelation:
    return connect(artifact_root).sql(query)
