"""What a config asks of memory, estimated before any model loads, and a refusal when it will not fit.

One deployment parameter (``batch_size=4096 max_new_tokens=2048``) could
otherwise ask for hundreds of GB and take the worker down with it. The
estimate is the largest of the phases' working sets (they do not overlap) on
top of the weights, from the model's config.json alone: float32 weights, the
sampler's KV cache and logits per generation chunk, scoring's logits per
chunk, and the frozen-trunk activations of the whole batch (shared by scoring
and training) plus a minibatch's activations and one chunk of the vocabulary
head's logits. It is deliberately rough (within ~2x):
its job is to refuse the absurd with the fields to change, not to tune.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from ppo_core.config import DEFAULT_MODEL, ConfigError, PPOConfig
from ppo_core.vocab_head import CHUNK_ROWS

GB = 1 << 30
F32 = 4
# SmolLM2-135M-Instruct (the default model), for estimating before its first conversion
SMOLLM2_DIMS = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152}
PROMPT_TOKENS_MARGIN = 64  # chat template tokens around a prompt
CHARS_PER_TOKEN = 3  # BPE on English text averages ~4; 3 errs on the side of more tokens


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    generation: int
    scoring: int
    training: int

    @property
    def total(self) -> int:
        return self.weights + max(self.generation, self.scoring, self.training)

    def describe(self) -> str:
        parts = {"weights": self.weights, "generation": self.generation, "scoring": self.scoring, "training": self.training}
        return ", ".join(f"{k} {v / GB:.1f} GB" for k, v in parts.items())


def model_dims(cfg: PPOConfig) -> dict[str, int]:
    if cfg.model == DEFAULT_MODEL:
        return SMOLLM2_DIMS
    path = Path(cfg.model).expanduser() / "config.json"
    try:
        dims = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # resolve_model_dir reports a missing or broken model directory, by name
    # a config.json without the sizes (or with text for them) cannot be estimated: the model load judges it
    sizes = [dims.get(k) for k in SMOLLM2_DIMS if k != "num_key_value_heads"] if isinstance(dims, dict) else [None]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return {}
    for key in ("num_key_value_heads", "head_dim"):
        if not isinstance(dims.get(key), int) or dims[key] <= 0:
            dims.pop(key, None)
    return dims


def longest_prompt_tokens(*prompt_sets: pl.DataFrame) -> int:
    """The longest prompt in tokens, estimated from its characters (no tokenizer loads here), plus the template."""
    longest = max((int(p["prompt"].str.len_chars().max() or 0) for p in prompt_sets), default=0)
    return -(-longest // CHARS_PER_TOKEN) + PROMPT_TOKENS_MARGIN


def estimate(cfg: PPOConfig, dims: dict[str, int], prompt_tokens: int) -> MemoryEstimate:
    h, layers = dims["hidden_size"], dims["num_hidden_layers"]
    heads, kv = dims["num_attention_heads"], dims.get("num_key_value_heads", dims["num_attention_heads"])
    head_dim = dims.get("head_dim") or h // heads
    vocab, inter = dims["vocab_size"], dims["intermediate_size"]
    params = vocab * h * (1 if dims.get("tie_word_embeddings", True) else 2) + layers * (
        2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter
    )
    rollouts = cfg.rollouts_per_iteration
    gen_rows = min(cfg.generation_batch_size, max(rollouts, cfg.eval_size))
    new_tokens = max(cfg.max_new_tokens, cfg.eval_max_new_tokens)
    seq = prompt_tokens + new_tokens
    # KV cache of every layer, and a few full-vocabulary tensors per sampling step (logits, softmax, sort)
    generation = 2 * layers * kv * head_dim * gen_rows * seq * F32 + 4 * gen_rows * vocab * F32
    # frozen-trunk activations of the whole batch, shared by scoring and training (ppo_core.score.TRUNKS)
    trunk = rollouts * seq * h * F32
    # the vocabulary head's working set: a few copies of one chunk of logits (ppo_core.vocab_head)
    head = 3 * CHUNK_ROWS * vocab * F32
    # one scoring chunk: hidden states of every position
    scoring = trunk + 4 * cfg.score_batch_size * seq * h * F32 + head
    # per minibatch, what autograd keeps of every trained layer (MLP intermediates, ~10 hidden-size
    # tensors, attention scores) and the head's per-token gradient rows
    minibatch = -(-rollouts // cfg.num_minibatches)
    per_token_layer = 3 * inter + 10 * h + heads * seq
    training = (
        trunk
        + minibatch * seq * per_token_layer * min(cfg.lora_layers, layers) * F32
        + 3 * minibatch * new_tokens * h * F32
        + head
    )
    return MemoryEstimate(params * F32, generation, scoring, training)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(cfg: PPOConfig, prompt_sets: list[pl.DataFrame], available: int | None = None) -> MemoryEstimate | None:
    """Refuse a config whose estimate exceeds this machine's memory, naming the fields that size it.

    ``prompt_sets``: the run's loaded prompt files (training, and evaluation if any).
    """
    dims = model_dims(cfg)
    if not dims:
        return None
    prompt_tokens = longest_prompt_tokens(*prompt_sets)
    est = estimate(cfg, dims, prompt_tokens)
    available = physical_memory() if available is None else available
    if est.total > 0.9 * available:
        raise ConfigError(
            f"this config needs about {est.total / GB:.0f} GB ({est.describe()}; longest prompt about "
            f"{prompt_tokens} tokens), more than this machine's {available / GB:.0f} GB: shorten the longest "
            f"prompts, or lower batch_size x samples_per_prompt ({cfg.rollouts_per_iteration}), "
            f"max_new_tokens ({cfg.max_new_tokens}), eval_max_new_tokens ({cfg.eval_max_new_tokens}), "
            f"generation_batch_size ({cfg.generation_batch_size}), score_batch_size ({cfg.score_batch_size}) "
            f"or raise num_minibatches ({cfg.num_minibatches})"
        )
    return est
