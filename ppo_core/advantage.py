"""Advantage estimators, vectorised over a ragged batch: GAE and the critic-free ones.

Rows arrive rollout-major (all tokens of rollout 0, then rollout 1, ...). They
are scattered into a zero-padded (B, T) grid; because padding rewards and
values are zero, the backward recursion A_t = delta_t + gamma*lam*A_{t+1} is a
linear filter along the reversed time axis and runs as one scipy call.

Every estimator fills the same four columns, so the advantages table keeps one
schema: ``advantage`` is the estimator's own, ``whitened`` what the policy
loss uses (batch-whitened where the estimator calls for it), ``returns`` the
value model's target (the discounted return where there is no value model)
and ``td_error`` r_t + gamma*V_{t+1} - V_t (with V = 0 without a value model).

The critic-free estimators score whole responses. Rollouts are grouped by
prompt: rollout r is sample r mod k of the batch's prompt r // k. With
R_i = score_i - kl_coef * sum_t KL_t, a response's total shaped reward:
- grpo (Shao et al. 2024): A_i,t = (s_i - mean_g s) / (std_g s + 1e-4) + K_i,t, the score s
  normalised within its group (std with ddof 1, as TRL) plus the KL penalty's reward-to-go
  K_i,t = -kl_coef * sum_{t' >= t} KL_t'. The penalty stays out of the std: in a group whose
  scores tie, dividing by a std made of KL noise alone would blow that noise up to unit size.
  (The paper puts the KL in the loss; this keeps it in the rewards table, like every estimator.)
- dr_grpo (Liu et al. 2025): A_i = R_i - mean_g R, no division by a std, so the KL can stay in R
- rloo (Ahmadian et al. 2024; TRL): A_i = R_i - mean of the group's other k-1 R
- reinforce_pp (Hu 2025): A_t = the discounted per-token return, whitened over the batch
A response-level advantage is given to every one of its tokens; the policy
loss averages over all tokens of a minibatch, as for PPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter


@dataclass
class AdvantageResult:
    td_error: np.ndarray
    advantage: np.ndarray
    whitened: np.ndarray
    returns: np.ndarray


def to_grid(flat: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat rollout-major rows -> zero-padded (B, T) grid and its boolean mask."""
    lengths = np.asarray(lengths)
    T = int(lengths.max()) if lengths.size else 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    grid = np.zeros(mask.shape, dtype=np.float64)
    grid[mask] = flat
    return grid, mask


def discounted_cumsum_reversed(x: np.ndarray, discount: float) -> np.ndarray:
    """y_t = x_t + discount * y_{t+1} along axis 1."""
    return lfilter([1.0], [1.0, -discount], x[:, ::-1], axis=1)[:, ::-1]


def gae(
    rewards: np.ndarray, values: np.ndarray, lengths: np.ndarray, gamma: float, lam: float, whiten: bool = True
) -> AdvantageResult:
    """Generalised advantage estimation; the state after a response's last token is terminal."""
    r, mask = to_grid(rewards, lengths)
    v, _ = to_grid(values, lengths)
    next_v = np.zeros_like(v)
    next_v[:, :-1] = v[:, 1:]  # zero past the end: terminal
    delta = r + gamma * next_v - v
    adv = discounted_cumsum_reversed(delta, gamma * lam)
    adv_flat = adv[mask]
    returns = adv_flat + values
    whitened = whiten_array(adv_flat) if whiten else adv_flat.copy()
    return AdvantageResult(delta[mask], adv_flat, whitened, returns)


GROUP_STD_EPS = 1e-4


def sequence_returns(rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """R_i: the sum of each rollout's per-token rewards (score at the last token plus the KL penalties)."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.add.reduceat(rewards, starts) if rewards.size else np.zeros(len(lengths))


def group_advantages(returns: np.ndarray, group_size: int, estimator: str) -> np.ndarray:
    """Per-rollout advantage of grpo, dr_grpo or rloo; rollouts come in consecutive groups of ``group_size``."""
    if returns.size % group_size:
        raise ValueError(f"{returns.size} rollouts do not split into groups of {group_size}")
    grid = returns.reshape(-1, group_size)
    mean = grid.mean(axis=1, keepdims=True)
    if estimator == "grpo":
        out = (grid - mean) / (grid.std(axis=1, ddof=1, keepdims=True) + GROUP_STD_EPS)
    elif estimator == "dr_grpo":
        out = grid - mean
    elif estimator == "rloo":
        out = grid - (grid.sum(axis=1, keepdims=True) - grid) / (group_size - 1)
    else:
        raise ValueError(f"unknown group estimator {estimator!r}")
    return out.reshape(-1)


def critic_free(
    estimator: str,
    rewards: np.ndarray,
    lengths: np.ndarray,
    group_size: int,
    gamma: float,
    whiten: bool,
    kl_penalty: np.ndarray | None = None,
) -> AdvantageResult:
    """grpo, dr_grpo, rloo or reinforce_pp over flat rollout-major per-token rewards.

    ``kl_penalty`` (-kl_coef * KL_t per token, default none) is the part of
    ``rewards`` that grpo keeps out of its group normalisation.
    """
    lengths = np.asarray(lengths)
    r, mask = to_grid(rewards, lengths)
    token_returns = discounted_cumsum_reversed(r, gamma)[mask]
    if estimator == "reinforce_pp":
        return AdvantageResult(rewards.copy(), token_returns, whiten_array(token_returns), token_returns)
    if estimator == "grpo":
        penalty = np.zeros_like(rewards) if kl_penalty is None else np.asarray(kl_penalty, dtype=np.float64)
        scores = sequence_returns(rewards - penalty, lengths)
        penalty_to_go = discounted_cumsum_reversed(to_grid(penalty, lengths)[0], 1.0)[mask]
        adv = np.repeat(group_advantages(scores, group_size, estimator), lengths) + penalty_to_go
        return AdvantageResult(rewards.copy(), adv, adv.copy(), token_returns)
    per_rollout = group_advantages(sequence_returns(rewards, lengths), group_size, estimator)
    adv = np.repeat(per_rollout, lengths)
    used = whiten_array(adv) if whiten and estimator == "rloo" else adv.copy()
    return AdvantageResult(rewards.copy(), adv, used, token_returns)


def whiten_array(x: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    if x.size < 2:
        return x - x.mean() if x.size else x
    return (x - x.mean()) / (x.std() + eps)
