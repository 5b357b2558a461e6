"""Work done by each phase of one PPO iteration, counted from its tables and the model's shape.

Matmul FLOPs (2 per multiply-add) of the dense layers, attention scores, the
LoRA adapters and the vocabulary head, over the positions each phase really
computes: padded batches, finished rows that keep decoding until the chunk
ends, both adapters in attribute, forward and backward in training (the
backward of a frozen weight is one matmul: the input's gradient, no weight
gradient). Decoding also reads every weight once per step, so its floor is
the larger of compute and memory traffic. Element-wise work is not counted:
it is what the floor leaves out, and what the gap to it shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ppo_core.score import TRUNK_CHUNK


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    lora_layers: int
    lora_rank: int
    lora_targets: int

    @classmethod
    def of(cls, config: dict, cfg) -> Shape:
        return cls(
            hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=config["num_attention_heads"],
            kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            intermediate=config["intermediate_size"], vocab=config["vocab_size"],
            lora_layers=min(cfg.lora_layers, config["num_hidden_layers"]), lora_rank=cfg.lora_rank,
            lora_targets=len(cfg.lora_targets),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate

    @property
    def weight_bytes(self) -> int:
        return 4 * (self.layers * self.layer_params + self.vocab * self.hidden)

    def layer_flops(self, positions: float, context: float, adapted: bool) -> float:
        """Forward FLOPs of one layer over ``positions`` tokens attending to ``context`` tokens each (on average)."""
        dense = 2 * positions * self.layer_params
        attention = 4 * positions * context * self.hidden
        lora = 2 * positions * self.lora_targets * 2 * self.hidden * self.lora_rank if adapted else 0
        return dense + attention + lora

    def stack_flops(self, positions: float, context: float, top: bool) -> float:
        n = self.lora_layers if top else self.layers - self.lora_layers
        return n * self.layer_flops(positions, context, adapted=top)

    def head_flops(self, positions: float) -> float:
        return 2 * positions * self.hidden * self.vocab


def _padded(rows: list[int], chunk: int) -> tuple[float, float]:
    """(positions, mean context) of right-padded chunks of ``chunk`` rows."""
    positions = context = 0.0
    for lo in range(0, len(rows), chunk):
        part = rows[lo : lo + chunk]
        width = max(part)
        positions += len(part) * width
        context += len(part) * width * (width + 1) / 2
    return positions, context / max(positions, 1)


@dataclass
class PhaseWork:
    gflop: float
    gbyte: float = 0.0  # memory traffic that bounds the phase (decoding's weight reads)


def iteration_work(shape: Shape, prompt_lens: np.ndarray, response_lens: np.ndarray, cfg) -> dict[str, PhaseWork]:
    """GFLOP (and GB read, for decoding) of rollout, attribute, value and train."""
    seq = (prompt_lens + response_lens).tolist()
    n_resp = float(response_lens.sum())
    # rollout: prefill of each chunk's left-padded prompts, then one step per new token for every row of the chunk
    prefill = decode = steps = 0.0
    chunk = cfg.generation_batch_size
    for lo in range(0, len(prompt_lens), chunk):
        p, r = prompt_lens[lo : lo + chunk], response_lens[lo : lo + chunk]
        width, n_steps = int(p.max()), int(r.max())
        prefill += shape.stack_flops(len(p) * width, width / 2, False) + shape.stack_flops(len(p) * width, width / 2, True)
        prefill += shape.head_flops(len(p))
        ctx = width + n_steps / 2
        decode += shape.stack_flops(len(p) * n_steps, ctx, False) + shape.stack_flops(len(p) * n_steps, ctx, True)
        decode += shape.head_flops(len(p) * n_steps)
        steps += n_steps
    rollout = PhaseWork((prefill + decode) / 1e9, steps * shape.weight_bytes / 1e9)
    # the frozen trunk over the whole padded batch, once (shared by attribute, value and train)
    pos_all, ctx_all = _padded(seq, TRUNK_CHUNK)
    trunk = shape.stack_flops(pos_all, ctx_all, False)
    pos, ctx = _padded(seq, cfg.score_batch_size)
    top = shape.stack_flops(pos, ctx, True)
    attribute = trunk + 2 * top + 2 * shape.head_flops(n_resp)
    value = top
    # training: per epoch, each minibatch's top layers forward and backward for the policy and the value model
    # (backward ~ forward: input gradients only, plus the adapters' small weight gradients), and the policy's head
    # forward (logits) plus its gradient rows (p @ W)
    mb_pos, mb_ctx = _padded(seq, max(1, len(seq) // cfg.num_minibatches))
    per_epoch = 2 * 2 * shape.stack_flops(mb_pos, mb_ctx, True) + 2 * shape.head_flops(n_resp)
    train = cfg.ppo_epochs * per_epoch
    return {
        "rollout": rollout,
        "attribute": PhaseWork(attribute / 1e9),
        "value": PhaseWork(value / 1e9),
        "train": PhaseWork(train / 1e9),
    }


def memory_bandwidth_gbs(size_mb: int = 256, repeats: int = 5) -> float:
    """Read bandwidth of one core (GB/s): summing a large float32 array."""
    import time

    a = np.ones(size_mb * (1 << 20) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9
