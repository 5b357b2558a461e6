"""One batched forward pass per model over prompt + response.

Per generated token t we need quantities of the state *before* it
(prompt + response[:t]); with a causal model all of them come from a single
pass over the full sequence, read at positions ``len(prompt) - 1 + t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ppo_core.models import PolicyValueModel


@dataclass
class Batch:
    """Right-padded prompt+response tokens and where each response token is predicted."""

    tokens: mx.array  # (B, L) int32
    positions: mx.array  # (B, T) int32: index of the hidden state that predicts response token t
    targets: mx.array  # (B, T) int32: response token ids (pad where masked)
    mask: mx.array  # (B, T) float32: 1 for real response tokens

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> Batch:
    B = len(prompt_ids)
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    L = max(len(s) for s in seqs)
    T = max(1, max(len(r) for r in response_ids))
    tokens = np.full((B, L), pad_id, dtype=np.int32)
    targets = np.full((B, T), pad_id, dtype=np.int32)
    mask = np.zeros((B, T), dtype=np.float32)
    positions = np.zeros((B, T), dtype=np.int32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        tokens[i, : len(p) + len(r)] = p + r
        targets[i, : len(r)] = r
        mask[i, : len(r)] = 1.0
        positions[i] = np.minimum(len(p) - 1 + np.arange(T), L - 1)
    return Batch(mx.array(tokens), mx.array(positions), mx.array(targets), mx.array(mask))


TRUNK_CHUNK = 16  # rows per pass when precomputing frozen-layer activations for a whole batch


def trunk_activations(model: PolicyValueModel, tokens: mx.array, chunk: int = TRUNK_CHUNK) -> mx.array:
    """Frozen-layer activations of every row of ``tokens``, computed ``chunk`` rows at a time.

    Training reuses them in every epoch and for every adapter; chunking bounds
    the memory of the pass itself.
    """
    parts = []
    for lo in range(0, tokens.shape[0], chunk):
        part = model.trunk(tokens[lo : lo + chunk])
        mx.eval(part)
        parts.append(part)
    return mx.concatenate(parts, axis=0)


def response_hidden(model: PolicyValueModel, batch: Batch, adapter: str | None, trunk: mx.array | None = None) -> mx.array:
    """(B, T, H) hidden states of the states that precede each response token.

    ``trunk`` (from ``model.trunk(batch.tokens)``) lets several adapters share
    one pass through the frozen lower layers.
    """
    h = model.top(model.trunk(batch.tokens) if trunk is None else trunk, adapter)
    return mx.take_along_axis(h, batch.positions[..., None], axis=1)


def token_logprobs(
    model: PolicyValueModel,
    batch: Batch,
    adapter: str | None,
    temperature: float,
    trunk: mx.array | None = None,
    with_entropy: bool = True,
) -> tuple[mx.array, mx.array | None]:
    """(logprob of each response token, entropy of each step's distribution or None), (B, T).

    Work over the vocabulary dominates the cost of the top layers on CPU, so
    entropy (one more full-vocabulary pass) is computed only when asked for.
    """
    logits = model.logits_from_hidden(response_hidden(model, batch, adapter, trunk)) / temperature
    lse = mx.logsumexp(logits, axis=-1)
    chosen = mx.take_along_axis(logits, batch.targets[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
        return chosen, None
    entropy = lse - (mx.softmax(logits, axis=-1) * logits).sum(axis=-1)
    return chosen, entropy


def token_values(model: PolicyValueModel, batch: Batch, adapter: str | None = "value", trunk: mx.array | None = None) -> mx.array:
    return model.value_from_hidden(response_hidden(model, batch, adapter, trunk))


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def _ragged(arr: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Concatenate the first lengths[i] entries of each row: token-major flat order."""
    mask = np.arange(arr.shape[1])[None, :] < np.asarray(lengths)[:, None]
    return arr[mask]


def score_logprobs(
    model: PolicyValueModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    *,
    adapters: tuple[str | None, ...],
    temperature: float,
    batch_size: int,
    entropy: tuple[bool, ...] | None = None,
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Flat per-token (logprob, entropy or None), rollout-major, per adapter (None = reference).

    All adapters share one pass through the frozen trunk per chunk.
    """
    entropy = entropy or (True,) * len(adapters)
    out: list[tuple[list[np.ndarray], list[np.ndarray]]] = [([], []) for _ in adapters]
    for sl in _chunks(len(prompt_ids), batch_size):
        b = make_batch(prompt_ids[sl], response_ids[sl], model.pad_token_id)
        trunk = model.trunk(b.tokens)
        lens = [len(r) for r in response_ids[sl]]
        for (lps, ents), adapter, with_ent in zip(out, adapters, entropy):
            lp, ent = token_logprobs(model, b, adapter, temperature, trunk, with_ent)
            mx.eval(lp, ent) if with_ent else mx.eval(lp)
            lps.append(_ragged(np.array(lp), lens))
            if with_ent:
                ents.append(_ragged(np.array(ent), lens))
    return [(np.concatenate(lps), np.concatenate(ents) if ents else None) for lps, ents in out]


def score_values(
    model: PolicyValueModel, prompt_ids: list[list[int]], response_ids: list[list[int]], *, batch_size: int
) -> np.ndarray:
    """Flat per-token V(s_t) for every response token, rollout-major."""
    out = []
    for sl in _chunks(len(prompt_ids), batch_size):
        b = make_batch(prompt_ids[sl], response_ids[sl], model.pad_token_id)
        v = token_values(model, b)
        mx.eval(v)
        out.append(_ragged(np.array(v), [len(r) for r in response_ids[sl]]))
    return np.concatenate(out)
