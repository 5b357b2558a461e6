"""One batched forward pass per model over prompt + response.

Per generated token t we need quantities of the state *before* it
(prompt + response[:t]); with a causal model all of them come from a single
pass over the full sequence, read at positions ``len(prompt) - 1 + t``.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ppo_core.models import PolicyValueModel
from ppo_core.vocab_head import head_stats


@dataclass
class Batch:
    """Right-padded prompt+response tokens and where each response token is predicted."""

    tokens: mx.array  # (B, L) int32
    positions: mx.array  # (B, T) int32: index of the hidden state that predicts response token t
    targets: mx.array  # (B, T) int32: response token ids (pad where masked)
    mask: mx.array  # (B, T) float32: 1 for real response tokens
    # the real response tokens only, rollout-major (the order of the tables' rows):
    flat_rows: mx.array  # (N,) int32: index into the (B * L) hidden states of the state predicting each
    flat_targets: np.ndarray  # (N,) int32: the token ids
    grid_index: mx.array  # (B, T) int32: where each grid cell's value is in the flat order (N for padding)
    flat_cells: mx.array  # (N,) int32: each real token's cell in the flattened (B * T) grid

    @property
    def n_tokens(self) -> int:
        return len(self.flat_targets)


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
    real = mask > 0
    flat_rows = (np.arange(B)[:, None] * L + positions)[real].astype(np.int32)
    grid_index = np.full((B, T), real.sum(), dtype=np.int32)
    grid_index[real] = np.arange(real.sum(), dtype=np.int32)
    return Batch(
        mx.array(tokens), mx.array(positions), mx.array(targets), mx.array(mask),
        mx.array(flat_rows), targets[real], mx.array(grid_index), mx.array(np.flatnonzero(real).astype(np.int32)),
    )


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


class TrunkCache:
    """The frozen-trunk activations of the most recent token batches, per loaded model.

    Attribute, value and train of one iteration read the same rollouts, and
    the layers below the adapters are the same for every adapter, so one pass
    serves all three (when they run in one process; elsewhere each computes
    its own). Keyed by the tokens' bytes, so a different batch never hits.
    """

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[weakref.ref, mx.array]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, model: PolicyValueModel, tokens: mx.array) -> mx.array:
        arr = np.asarray(tokens)
        key = (id(model), model.n_frozen, arr.shape, hashlib.sha256(arr.tobytes()).hexdigest())
        with self._lock:
            # id() alone could name a new model loaded where a freed one was: the weak reference tells them apart
            if key in self._entries and self._entries[key][0]() is model:
                self.hits += 1
                self._entries.move_to_end(key)
                return self._entries[key][1]
            self.misses += 1
            if self.size == 1:  # free the old batch before computing the new one
                self._entries.clear()
            value = trunk_activations(model, tokens)
            self._entries[key] = (weakref.ref(model), value)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
            return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


TRUNKS = TrunkCache()  # the process's: phases of one iteration share the frozen pass through it


def _top(model: PolicyValueModel, batch: Batch, adapter: str | None, trunk: mx.array | None) -> mx.array:
    """(B, L, H) final hidden states; ``trunk`` (from ``model.trunk(batch.tokens)``) lets adapters share the frozen pass."""
    return model.top(model.trunk(batch.tokens) if trunk is None else trunk, adapter)


def flat_hidden(model: PolicyValueModel, batch: Batch, adapter: str | None, trunk: mx.array | None = None) -> mx.array:
    """(N, H) hidden states of the states that precede each real response token, rollout-major."""
    h = _top(model, batch, adapter, trunk)
    return h.reshape(-1, h.shape[-1])[batch.flat_rows]


def flat_to_grid(flat: mx.array, batch: Batch) -> mx.array:
    """(N,) values in the flat order -> the batch's (B, T) grid, 0 at padding."""
    return mx.concatenate([flat, mx.zeros((1,), flat.dtype)])[batch.grid_index]


def token_logprobs(
    model: PolicyValueModel,
    batch: Batch,
    adapter: str | None,
    temperature: float,
    trunk: mx.array | None = None,
    with_entropy: bool = True,
) -> tuple[mx.array, mx.array | None]:
    """(logprob of each response token, entropy of each step's distribution or None) on the (B, T) grid, 0 at padding.

    No gradient flows through it: training takes the head's gradient in
    ``ppo_core.train.PPOStep``.
    """
    lp, ent = flat_logprobs(model, batch, adapter, temperature, model.trunk(batch.tokens) if trunk is None else trunk, with_entropy)
    return flat_to_grid(mx.array(lp), batch), (flat_to_grid(mx.array(ent), batch) if with_entropy else None)


def flat_logprobs(
    model: PolicyValueModel, batch: Batch, adapter: str | None, temperature: float, trunk: mx.array, with_entropy: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scoring without gradients: (logprob, entropy or None) of the real response tokens, rollout-major."""
    h = flat_hidden(model, batch, adapter, trunk)
    mx.eval(h)
    st = head_stats(model, h, batch.flat_targets, temperature, entropy=with_entropy)
    return st.logprob, st.entropy


def token_values(model: PolicyValueModel, batch: Batch, adapter: str | None = "value", trunk: mx.array | None = None) -> mx.array:
    h = _top(model, batch, adapter, trunk)
    return model.value_from_hidden(mx.take_along_axis(h, batch.positions[..., None], axis=1))


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def _batch_trunks(model: PolicyValueModel, prompt_ids: list[list[int]], response_ids: list[list[int]], batch_size: int):
    """(chunk's Batch, its trunk activations) per ``batch_size`` rollouts, from one shared whole-batch trunk pass."""
    trunk_all = TRUNKS.get(model, make_batch(prompt_ids, response_ids, model.pad_token_id).tokens)
    for sl in _chunks(len(prompt_ids), batch_size):
        b = make_batch(prompt_ids[sl], response_ids[sl], model.pad_token_id)
        yield b, trunk_all[sl][:, : b.tokens.shape[1]]


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

    All adapters share one pass through the frozen trunk (``TRUNKS``).
    """
    entropy = entropy or (True,) * len(adapters)
    out: list[tuple[list[np.ndarray], list[np.ndarray]]] = [([], []) for _ in adapters]
    for b, trunk in _batch_trunks(model, prompt_ids, response_ids, batch_size):
        for (lps, ents), adapter, with_ent in zip(out, adapters, entropy):
            lp, ent = flat_logprobs(model, b, adapter, temperature, trunk, with_ent)
            lps.append(lp)
            if with_ent:
                ents.append(ent)
    return [(np.concatenate(lps), np.concatenate(ents) if ents else None) for lps, ents in out]


def score_values(
    model: PolicyValueModel, prompt_ids: list[list[int]], response_ids: list[list[int]], *, batch_size: int
) -> np.ndarray:
    """Flat per-token V(s_t) for every response token, rollout-major."""
    out = []
    for b, trunk in _batch_trunks(model, prompt_ids, response_ids, batch_size):
        v = model.value_from_hidden(flat_hidden(model, b, "value", trunk))
        mx.eval(v)
        out.append(np.array(v))
    return np.concatenate(out)
