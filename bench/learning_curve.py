"""Print a run's learning curve (markdown) from its tables: eval reward, train reward, KL, entropy.

Usage: python bench/learning_curve.py --run default [--root artifacts]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ppo_core  # noqa: F401
from ppo_core.config import PROJECT_ROOT
from ppo_core.query import connect

QUERY = """
with ev as (select iter, avg(score) as eval_score, avg(response_tokens) as eval_len from eval where run = $run group by 1),
     ro as (select iter, avg(len(response_token_ids)) as resp_len,
                   avg(case when finish_reason = 'eos' then 1 else 0 end) as eos_frac from rollouts where run = $run group by 1),
     rw as (select iter, sum(score) / count(distinct rollout_id) as train_score from rewards where run = $run group by 1),
     sa as (select iter, sum(kl) / count(distinct rollout_id) as kl_per_rollout, avg(entropy) as entropy
            from sa_pairs where run = $run group by 1)
select ev.iter, eval_score, eval_len, train_score, kl_per_rollout, entropy, resp_len, eos_frac
from ev left join rw using (iter) left join sa using (iter) left join ro using (iter) order by ev.iter
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="default")
    ap.add_argument("--root", type=Path, default=PROJECT_ROOT / "artifacts")
    args = ap.parse_args()
    df = connect(args.root).sql(QUERY, params={"run": args.run}).pl()
    cols = df.columns
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in df.iter_rows():
        print("| " + " | ".join("" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v)) for v in row) + " |")


if __name__ == "__main__":
    main()
