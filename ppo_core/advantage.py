"""GAE, returns and whitening, vectorised over a ragged batch.

Rows arrive rollout-major (all tokens of rollout 0, then rollout 1, ...). They
are scattered into a zero-padded (B, T) grid; because padding rewards and
values are zero, the backward recursion A_t = delta_t + gamma*lam*A_{t+1} is a
linear filter along the reversed time axis and runs as one scipy call.
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


def whiten_array(x: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    if x.size < 2:
        return x - x.mean() if x.size else x
    return (x - x.mean()) / (x.std() + eps)
