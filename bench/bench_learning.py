"""Learning with each advantage estimator on the shipped VADER task, at the same generated tokens.

Every estimator samples 32 rollouts of up to 40 tokens per iteration (PPO and
REINFORCE++: 32 prompts x 1; GRPO and RLOO: 8 prompts x 4) on the default
config, with the adaptive KL controller holding KL per response near a target.
Each run is tracked in MLflow (compare them in the UI) and its tables stay
queryable.

    python bench/bench_learning.py run ppo --iterations 10     # one estimator (run name learn-ppo)
    python bench/bench_learning.py table ppo grpo rloo          # eval score and KL per iteration, side by side
"""

from __future__ import annotations

from pathlib import Path

import typer

import ppo_core  # noqa: F401  (BLAS set-up before mlx)
from ppo_core.config import PROJECT_ROOT, load_config
from ppo_core.query import connect

ROLLOUTS = 32
KL = {"adaptive_kl": True, "kl_target": 2.0, "kl_horizon": ROLLOUTS // 2}  # up to +-40% of kl_coef per iteration
ESTIMATORS = {
    "ppo": {"advantage_estimator": "gae", "batch_size": ROLLOUTS},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp", "batch_size": ROLLOUTS},
    "grpo": {"advantage_estimator": "grpo", "batch_size": ROLLOUTS // 4, "samples_per_prompt": 4},
    "dr_grpo": {"advantage_estimator": "dr_grpo", "batch_size": ROLLOUTS // 4, "samples_per_prompt": 4},
    "rloo": {"advantage_estimator": "rloo", "batch_size": ROLLOUTS // 4, "samples_per_prompt": 4},
}

QUERY = """
with ev as (select run, iter, avg(score) as eval_score from eval where run in (select unnest($runs)) group by all),
     sa as (select run, iter, sum(kl) / count(distinct rollout_id) as kl from sa_pairs where run in (select unnest($runs)) group by all)
select ev.run, ev.iter, eval_score, kl from ev left join sa using (run, iter) order by ev.run, ev.iter
"""

app = typer.Typer(add_completion=False)


@app.command()
def run(
    estimator: str,
    iterations: int = 10,
    root: Path = PROJECT_ROOT / "artifacts",
    prefix: str = "learn-",
    kl_coef: float = 0.05,
    kl_target: float = KL["kl_target"],
    kl_horizon: int = KL["kl_horizon"],
) -> None:
    """Train ``iterations`` iterations of one estimator's run (resumes where it stopped)."""
    from ppo_core.pipeline import run_tracked

    kl = {**KL, "kl_coef": kl_coef, "kl_target": kl_target, "kl_horizon": kl_horizon}
    cfg = load_config(None, {**kl, **ESTIMATORS[estimator], "run": f"{prefix}{estimator}", "artifact_root": root})
    run_tracked(cfg, iterations)


@app.command()
def table(estimators: list[str], root: Path = PROJECT_ROOT / "artifacts", prefix: str = "learn-") -> None:
    """Markdown: held-out eval score and KL per rollout per iteration, one column pair per estimator."""
    df = connect(root).sql(QUERY, params={"runs": [f"{prefix}{e}" for e in estimators]}).pl()
    iters = sorted(set(df["iter"].to_list()))
    print("| iter | " + " | ".join(f"{e} eval | {e} KL" for e in estimators) + " |")
    print("|---|" + "---|---|" * len(estimators))
    cells = {(r, i): (s, k) for r, i, s, k in df.iter_rows()}
    for i in iters:
        row = []
        for e in estimators:
            s, k = cells.get((f"{prefix}{e}", i), (None, None))
            row += [f"{s:.3f}" if s is not None else "", f"{k:.2f}" if k is not None else ""]
        print(f"| {i} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    app()
