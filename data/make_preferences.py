"""Build data/preferences.jsonl from SmolLM2 responses stored in an artifact store.

Provenance of the shipped file: responses sampled (rollouts, temperature 1) and
generated greedily (eval) by SmolLM2-135M-Instruct during PPO runs on this
project's prompts. Label rule, checkable by tests: for two responses to the
same prompt whose VADER compound scores differ by at least MARGIN, the more
positive one is `chosen`.

Usage: python data/make_preferences.py --root artifacts --out data/preferences.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

import ppo_core  # noqa: F401
from ppo_core.query import connect
from ppo_core.rewards import VaderSentiment

MARGIN = 0.3
PER_PROMPT = 4


def build(root: Path, seed: int = 0) -> pl.DataFrame:
    con = connect(root)
    responses = con.sql(
        "select distinct prompt, trim(response) as response from rollouts "
        "union select distinct prompt, trim(response) from eval"
    ).pl().filter(pl.col("response").str.len_chars() > 10)
    vader = VaderSentiment()
    responses = responses.with_columns(
        vader=pl.Series(vader(responses["prompt"].to_list(), responses["response"].to_list(), None))
    )
    pairs = (
        responses.join(responses, on="prompt", suffix="_b")
        .filter(pl.col("vader") - pl.col("vader_b") >= MARGIN)
        .select("prompt", chosen="response", rejected="response_b", chosen_vader="vader", rejected_vader="vader_b")
        .sample(fraction=1.0, shuffle=True, seed=seed)
        .group_by("prompt", maintain_order=True).head(PER_PROMPT)
        .sort("prompt", "chosen", "rejected")
    )
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("artifacts"))
    ap.add_argument("--out", type=Path, default=Path("data/preferences.jsonl"))
    args = ap.parse_args()
    pairs = build(args.root)
    pairs.write_ndjson(args.out)
    print(f"{pairs.height} pairs over {pairs['prompt'].n_unique()} prompts -> {args.out}")


if __name__ == "__main__":
    main()
