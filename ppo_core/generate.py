"""Batched sampling with a KV cache over left-padded prompts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from ppo_core import progress
from ppo_core.faults import failpoint
from ppo_core.models import PolicyValueModel
from ppo_core.rope import share_rotation


@dataclass
class Generation:
    """Token ids of each response (EOS included when emitted) and how it ended."""

    response_ids: list[list[int]]
    finish_reasons: list[str]  # 'eos' | 'length'
    sampling_logprobs: list[list[float]]  # log p(token) under the tempered sampler


def render_prompts(model: PolicyValueModel, prompts: list[str]) -> list[list[int]]:
    """Chat-template each prompt as one user turn, ready for the assistant's answer."""
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        return [
            list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True))
            for p in prompts
        ]
    return [tok.encode(p) for p in prompts]


def row_seeds(key: str, rows) -> list[int]:
    """A seed for each row, from ``key`` (for example 'seed:iteration:phase') and the row's number."""
    return [int.from_bytes(hashlib.sha256(f"{key}:{int(r)}".encode()).digest()[:4], "little") & 0x7FFFFFFF for r in rows]


class _Positions:
    """Each row's position for the next token: one array object for every layer, advanced once per forward pass.

    So ``ppo_core.rope.SharedRoPE`` computes each step's rotation once, not once per layer and projection.
    """

    def __init__(self, left_padding: list[int]):
        self.offset = share_rotation(mx.array([-p for p in left_padding]))

    def advance(self, n: int) -> None:
        self.offset = share_rotation(self.offset + n)  # a new array: the previous step's is never changed


class DecodeCache(BatchKVCache):
    """One layer's KV cache over left-padded rows, allocated once for the whole sample (mlx_lm's grows in 256-step blocks).

    For ``generate`` only: it supports what a forward pass calls
    (``offset``, ``update_and_fetch``, ``make_mask``); mlx-lm's methods that
    move positions (``trim``, ``filter``, ``extend``, a ``state`` set) are refused.
    """

    def __init__(self, left_padding: list[int], positions: _Positions, capacity: int):
        self.left_padding = mx.array(left_padding)
        self.keys = self.values = None
        self._idx, self._right_padding = 0, None
        self._positions, self._capacity = positions, capacity

    @property
    def offset(self) -> mx.array:
        return self._positions.offset

    @offset.setter
    def offset(self, value: mx.array) -> None:
        raise NotImplementedError("DecodeCache positions advance once per forward pass (_Positions.advance), never per layer")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            B, heads, _, _ = keys.shape
            self.keys = mx.zeros((B, heads, self._capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, heads, self._capacity, values.shape[3]), values.dtype)
        prev, self._idx = self._idx, self._idx + keys.shape[2]
        if self._idx > self._capacity:
            raise ValueError(f"decode cache of {self._capacity} positions overflows at {self._idx}")
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]


_split_rows = mx.vmap(mx.random.split)


def _uniform_rows(keys: mx.array, vocab: int) -> mx.array:
    """(B, vocab) uniforms, row i from ``keys[i]``: the draws ``mx.random.categorical`` turns into Gumbel noise."""
    return mx.vmap(lambda key: mx.random.uniform(shape=(vocab,), key=key))(keys)


def _sample_step(logits: np.ndarray, temperature: float, uniforms: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(next token, its log-probability under the tempered distribution) per row.

    Gumbel-max over the log-probabilities, as ``mx.random.categorical`` does,
    in NumPy: MLX's CPU ``exp`` and ``log`` are scalar, and over a
    49,152-way vocabulary they cost as much per step as the model's layers.
    """
    scaled = logits if temperature == 0 else np.divide(logits, np.float32(temperature), dtype=np.float32)
    shifted = scaled - scaled.max(axis=1, keepdims=True)
    lp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    if uniforms is None:
        nxt = lp.argmax(axis=1)
    else:
        nxt = (lp - np.log(-np.log(uniforms))).argmax(axis=1)
    return nxt, lp[np.arange(len(nxt)), nxt]


def generate(
    model: PolicyValueModel,
    prompt_ids: list[list[int]],
    *,
    adapter: str | None,
    max_new_tokens: int,
    temperature: float,
    seeds: list[int] | None = None,
) -> Generation:
    """Sample responses for all prompts at once; ``temperature == 0`` is greedy.

    Row i's randomness comes only from ``seeds[i]`` (default: its index): the
    same seed gives the same tokens whatever else is in the batch, so a shard
    of a batch samples what the whole batch would (up to float rounding).
    There is no top-p: the config refuses it (PPO scores the full tempered distribution).
    """
    B = len(prompt_ids)
    lengths = [len(p) for p in prompt_ids]
    max_len = max(lengths)
    left_pad = [max_len - n for n in lengths]
    tokens = mx.array([[model.pad_token_id] * pad + p for pad, p in zip(left_pad, prompt_ids)], dtype=mx.int32)
    positions = _Positions(left_pad)
    cache = [DecodeCache(left_pad, positions, max_len + max_new_tokens) for _ in model.backbone.layers]
    eos = np.array(model.eos_token_ids)
    # one key per row, split per step on device: no row's draw depends on another's
    keys = mx.stack([mx.random.key(s) for s in (seeds if seeds is not None else range(B))])

    out_tokens, out_lp = [], []
    finished = np.zeros(B, dtype=bool)
    done_at = np.full(B, -1)
    x = tokens
    for step in range(max_new_tokens):
        h = model.hidden(x, adapter, cache=cache)[:, -1, :]
        positions.advance(x.shape[1])
        logits = model.logits_from_hidden(h).astype(mx.float32)  # sampling logprobs in float32 on any model dtype
        uniforms = None
        if temperature != 0:
            split = _split_rows(keys)
            keys = split[:, 0]
            uniforms = _uniform_rows(split[:, 1], logits.shape[-1])
            mx.eval(logits, uniforms, keys)
        else:
            mx.eval(logits)
        nxt, tok_lp = _sample_step(np.asarray(logits), temperature, None if uniforms is None else np.asarray(uniforms))
        progress.advance(int((~finished).sum()))  # tokens sampled this step
        nxt = np.where(finished, model.pad_token_id, nxt).astype(np.int32)
        is_eos = np.isin(nxt, eos) & ~finished
        finished |= is_eos
        out_tokens.append(nxt)
        out_lp.append(tok_lp.astype(np.float32))
        done_at[is_eos] = step
        failpoint("generate.step")
        if finished.all():
            break
        x = mx.array(nxt[:, None])

    toks = np.stack(out_tokens, axis=1)
    lps = np.stack(out_lp, axis=1)
    n_steps = toks.shape[1]
    ends = np.where(done_at >= 0, done_at + 1, n_steps)
    return Generation(
        response_ids=[toks[i, : ends[i]].tolist() for i in range(B)],
        finish_reasons=["eos" if done_at[i] >= 0 else "length" for i in range(B)],
        sampling_logprobs=[lps[i, : ends[i]].astype(float).tolist() for i in range(B)],
    )


def generate_chunked(
    model: PolicyValueModel, prompt_ids: list[list[int]], *, chunk: int, seeds: list[int], what: str = "sampling", **kwargs
) -> Generation:
    """``generate`` over ``chunk`` prompts at a time: the same tokens (each row keyed by its seed), bounded memory.

    Its progress is reported as ``what`` (``ppo_core.progress``), in tokens out of at most every row's maximum.
    """
    with progress.report(what, len(prompt_ids) * kwargs["max_new_tokens"], "tokens"):
        parts = [
            generate(model, prompt_ids[lo : lo + chunk], seeds=seeds[lo : lo + chunk], **kwargs)
            for lo in range(0, len(prompt_ids), chunk)
        ]
    return Generation(
        response_ids=[r for p in parts for r in p.response_ids],
        finish_reasons=[f for p in parts for f in p.finish_reasons],
        sampling_logprobs=[lp for p in parts for lp in p.sampling_logprobs],
    )


def decode_responses(model: PolicyValueModel, response_ids: list[list[int]]) -> list[str]:
    eos = set(model.eos_token_ids)
    return [model.tokenizer.decode([t for t in ids if t not in eos]) for ids in response_ids]
