"""A synthetic artifact store for query and report tests: known data, written with ``write_table``.

2 runs x 3 iterations x 20 rollouts of 1..12 tokens, plus an evaluation-only
iteration 0 per run. ``build_store`` returns the same data as Polars frames
(with ``run``/``iter`` columns) for independent checks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from ppo_core.advantage import gae
from ppo_core.layout import RunLayout
from ppo_core.tables import write_table

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


def build_store(root: Path) -> dict[str, pl.DataFrame]:
    """Write the store; return the same data as Polars frames (with run/iter) for the checks."""
    rng = np.random.default_rng(20240607)
    prompts = [f"Prompt {k}: tell me about thing {k}." for k in range(N_PROMPTS)]
    tracked = int(TRACKED_PROMPT.removeprefix("train-"))
    ro_frames, tok_frames, met_frames = [], [], []
    for run in RUNS:
        # an evaluation-only iteration 0, as the pipeline writes it (no token tables there)
        write_table(
            RunLayout(root, run).iter_dir(0),
            "eval",
            {"prompt_id": ["eval-0000"], "prompt": ["p"], "response": ["r"], "response_tokens": [1],
             "finish_reason": ["eos"], "score": [0.5], "prompt_token_ids": [[1, 2]], "response_token_ids": [[3]]},
        )  # fmt: skip
        for it in ITERS:
            iter_dir = RunLayout(root, run).iter_dir(it)
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
