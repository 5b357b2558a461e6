"""Benchmark: `ppo report` (ppo_core.report.build_report) over a large run.

Builds the synthetic store of bench_query.py (default 50 iterations x 100k
token rows = 5M rows, ~780 rollouts per iteration), then times build_report
(the first call, and the median of ``--repeat`` more) and prints JSON with the
size of the page it wrote.
Usage: python bench/bench_report.py [--iterations 50] [--tokens 100000] [--repeat 3]
"""

from __future__ import annotations

import json

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

from bench_query import RUN, store_arguments, synthetic_store, timed
from ppo_core.layout import RunLayout
from ppo_core.report import build_report


def main() -> None:
    args = store_arguments(__doc__.splitlines()[0], repeat=3).parse_args()
    with synthetic_store(args.root, args.iterations, args.tokens) as (root, _):
        times = timed(lambda: build_report(root, RUN), args.repeat, digits=2)
        page = RunLayout(root, RUN).report
        print(json.dumps({"token_rows": args.iterations * args.tokens, "iterations": args.iterations, **times,
                          "page_kb": round(page.stat().st_size / 1024)}, indent=2))


if __name__ == "__main__":
    main()
