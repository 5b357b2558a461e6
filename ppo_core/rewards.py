"""Reward functions behind one interface, and per-token KL shaping.

A reward function scores whole responses: ``fn(prompts, responses, n_tokens)
-> float array``, where ``responses`` is the decoded text and ``n_tokens`` the
number of generated tokens, the end-of-sequence token not counted. A function
that scores token ids (the learned reward model) also has
``score_token_ids(prompt_ids, response_ids)``, given exactly what was
generated. Shaping turns scores into per-token rewards:
``reward_t = -kl_coef * KL_t`` plus the score at the last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import polars as pl


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


class RewardFunction(Protocol):
    name: str

    def __call__(self, prompts: list[str], responses: list[str], n_tokens: np.ndarray) -> np.ndarray: ...


@dataclass
class VaderSentiment:
    """VADER compound sentiment of the response, in [-1, 1]."""

    name: str = "vader"

    def __post_init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._analyzer = SentimentIntensityAnalyzer()

    def __call__(self, prompts: list[str], responses: list[str], n_tokens: np.ndarray) -> np.ndarray:
        return np.array([self._analyzer.polarity_scores(r)["compound"] for r in responses], dtype=np.float64)


@dataclass
class LengthWindow:
    """1 inside [lo, hi] tokens, falling linearly to 0 at 0 and at 2*hi."""

    lo: int
    hi: int
    name: str = "length"

    def __call__(self, prompts: list[str], responses: list[str], n_tokens: np.ndarray) -> np.ndarray:
        n = np.asarray(n_tokens, dtype=np.float64)
        below = n / max(self.lo, 1)
        above = 1.0 - (n - self.hi) / max(self.hi, 1)
        return np.clip(np.where(n < self.lo, below, np.where(n > self.hi, above, 1.0)), 0.0, 1.0)


@dataclass
class KeywordReward:
    """1 if the response mentions any keyword (case-insensitive, whole word), else 0."""

    keywords: tuple[str, ...]
    name: str = "keyword"

    def __call__(self, prompts: list[str], responses: list[str], n_tokens: np.ndarray) -> np.ndarray:
        pattern = r"(?i)\b(" + "|".join(self.keywords) + r")\b"
        return pl.Series(responses, dtype=pl.String).str.contains(pattern).cast(pl.Float64).to_numpy()


def make_reward(spec: str, length_min: int, length_max: int) -> RewardFunction:
    """Build the reward function named by the config's ``reward`` field."""
    if spec == "vader":
        return VaderSentiment()
    if spec == "length":
        return LengthWindow(length_min, length_max)
    if spec.startswith("keyword:"):
        return KeywordReward(tuple(w for w in spec.removeprefix("keyword:").split(",") if w))
    if spec.startswith("python:"):
        from ppo_core.user_reward import load_user_reward

        return load_user_reward(spec)
    if spec.startswith("model:"):
        raise RewardError(f"reward '{spec}' needs the loaded model: use ppo_core.phases.reward_function")
    raise RewardError(f"unknown reward '{spec}'")


def score_responses(
    fn: RewardFunction,
    prompts: list[str],
    responses: list[str],
    n_tokens: np.ndarray,
    token_ids: tuple[list[list[int]], list[list[int]]] | None = None,
) -> np.ndarray:
    """Call ``fn`` and insist on one finite float per response.

    ``token_ids`` (prompt and response ids as generated) go to a function that
    scores tokens, so it sees what the policy produced rather than a re-encoding
    of the decoded text.
    """
    try:
        if token_ids is not None and hasattr(fn, "score_token_ids"):
            scores = fn.score_token_ids(*token_ids)
        else:
            scores = fn(prompts, responses, n_tokens)
        scores = np.asarray(scores, dtype=np.float64)
    except Exception as exc:
        raise RewardError(f"reward function '{fn.name}' raised {type(exc).__name__}: {exc}") from exc
    if scores.shape != (len(responses),):
        raise RewardError(f"reward function '{fn.name}' returned shape {scores.shape}, expected ({len(responses)},)")
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        raise RewardError(
            f"reward function '{fn.name}' returned {bad.size} non-finite score(s), first at rollout {int(bad[0])}"
        )
    return scores


def shape_rewards(
    kl: np.ndarray, lengths: np.ndarray, scores: np.ndarray, kl_coef: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat per-token (score, kl_penalty, reward) for rollout-major token rows."""
    ends = np.cumsum(lengths) - 1
    score_t = np.zeros_like(kl, dtype=np.float64)
    score_t[ends] = scores
    penalty = -kl_coef * kl.astype(np.float64)
    return score_t, penalty, score_t + penalty


def adaptive_kl_coef(kl_coef: float, mean_kl: float, target: float, n_rollouts: int, horizon: int) -> float:
    """Ziegler et al. (2019) proportional controller: nudge kl_coef toward ``target`` KL per rollout.

    ``n_rollouts`` (sequences, not tokens) is how many samples the KL was
    measured on, and ``horizon`` is in the same unit, as in the paper, TRL and
    OpenRLHF: the rate does not depend on response length.
    """
    error = float(np.clip(mean_kl / target - 1.0, -0.2, 0.2))
    return kl_coef * (1.0 + error * n_rollouts / horizon)
