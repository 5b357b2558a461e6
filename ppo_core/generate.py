"""Batched sampling with a KV cache over left-padded prompts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from ppo_core.faults import failpoint
from ppo_core.models import PolicyValueModel


@dataclass
class Generation:
    """Token ids of each response (EOS included when emitted) and how it ended."""

    response_ids: list[list[int]]
    finish_reasons: list[str]  # 'eos' | 'length'
    sampling_logprobs: list[list[float]]  # log p(token) under the tempered, top-p filtered sampler


def render_prompts(model: PolicyValueModel, prompts: list[str]) -> list[list[int]]:
    """Chat-template each prompt as one user turn, ready for the assistant's answer."""
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        return [
            list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True))
            for p in prompts
        ]
    return [tok.encode(p) for p in prompts]


def _top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    if top_p >= 1.0:
        return logprobs
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    cum = mx.cumsum(mx.exp(sorted_lp), axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always keeps the argmax)
    keep_sorted = (cum - mx.exp(sorted_lp)) < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    filtered = mx.where(keep, logprobs, -mx.inf)
    return filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)


def row_seeds(key: str, rows) -> list[int]:
    """A seed for each row, from ``key`` (for example 'seed:iteration:phase') and the row's number."""
    return [int.from_bytes(hashlib.sha256(f"{key}:{int(r)}".encode()).digest()[:4], "little") & 0x7FFFFFFF for r in rows]


_split_rows = mx.vmap(mx.random.split)
_sample_rows = mx.vmap(lambda key, logprobs: mx.random.categorical(logprobs, key=key))


def generate(
    model: PolicyValueModel,
    prompt_ids: list[list[int]],
    *,
    adapter: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seeds: list[int] | None = None,
) -> Generation:
    """Sample responses for all prompts at once; ``temperature == 0`` is greedy.

    Row i's randomness comes only from ``seeds[i]`` (default: its index): the
    same seed gives the same tokens whatever else is in the batch, so a shard
    of a batch samples what the whole batch would (up to float rounding).
    """
    B = len(prompt_ids)
    lengths = [len(p) for p in prompt_ids]
    max_len = max(lengths)
    left_pad = [max_len - n for n in lengths]
    tokens = mx.array([[model.pad_token_id] * pad + p for pad, p in zip(left_pad, prompt_ids)], dtype=mx.int32)
    cache = [BatchKVCache(left_pad) for _ in model.backbone.layers]
    eos = mx.array(list(model.eos_token_ids), dtype=mx.int32)
    # one key per row, split per step on device: no row's draw depends on another's
    keys = mx.stack([mx.random.key(s) for s in (seeds if seeds is not None else range(B))])

    out_tokens, out_lp = [], []
    finished = mx.zeros((B,), dtype=mx.bool_)
    done_at = np.full(B, -1)
    x = tokens
    for step in range(max_new_tokens):
        h = model.hidden(x, adapter, cache=cache)[:, -1, :]
        logits = model.logits_from_hidden(h)
        if temperature == 0:
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nxt = mx.argmax(lp, axis=-1)
        else:
            lp = logits / temperature
            lp = _top_p_filter(lp - mx.logsumexp(lp, axis=-1, keepdims=True), top_p)
            split = _split_rows(keys)
            keys = split[:, 0]
            nxt = _sample_rows(split[:, 1], lp)
        nxt = mx.where(finished, model.pad_token_id, nxt).astype(mx.int32)
        tok_lp = mx.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]
        is_eos = (nxt[:, None] == eos[None, :]).any(axis=-1) & ~finished
        finished = finished | is_eos
        mx.eval(nxt, tok_lp, finished)
        out_tokens.append(np.array(nxt))
        out_lp.append(np.array(tok_lp))
        done_at[np.array(is_eos)] = step
        failpoint("generate.step")
        if bool(finished.all()):
            break
        x = nxt[:, None]

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
    model: PolicyValueModel, prompt_ids: list[list[int]], *, chunk: int, seeds: list[int], **kwargs
) -> Generation:
    """``generate`` over ``chunk`` prompts at a time: the same tokens (each row keyed by its seed), bounded memory."""
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
