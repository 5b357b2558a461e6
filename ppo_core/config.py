"""PPOConfig: the one validated source of every knob.

Validation happens here, before any model is loaded, and every error names the
field and the allowed range.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ppo_core.layout import RunLayout, check_name

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2"
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # baselines from the other responses to the same prompt
# fields that change how, not what, a run computes: not part of its identity
EXECUTION_ONLY = ("generation_batch_size",)
# fields added after runs existed, whose default is those runs' behaviour
ADDED_FIELDS = (
    "samples_per_prompt", "advantage_estimator", "lr_schedule", "lr_warmup_steps", "lr_decay_iterations",
    "lr_min_ratio", "value_warmup_iterations", "dtype",
)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def artifact_root_problem(root: Path) -> str | None:
    """Why ``root`` cannot hold queryable tables, or None.

    DuckDB reads hive keys from every ``key=value`` folder of a file's full
    path and expands glob characters, so neither may appear above the runs.
    """
    for part in Path(root).expanduser().resolve().parts:
        if "=" in part:
            return f"folder '{part}' looks like a hive partition (contains '='), which would shadow the run/iter columns"
        if any(c in part for c in "*?[]{}"):
            return f"folder '{part}' contains a glob character (one of *?[]{{}})"
    return None


NAME_MAX = 255  # bytes of one file or folder name (Linux and macOS file systems)
PATH_MAX = 4096  # bytes of a whole path, its terminating NUL included (Linux)


def path_problem(value: str | Path) -> str | None:
    """Why ``value`` cannot name a file on this system, or None; it opens nothing.

    Such a value would otherwise fail later, deep in whatever first opens it,
    with a message that names neither the field nor the file.
    """
    text = str(value)
    if not text.strip():
        return "is empty: name a file or folder"
    if "\x00" in text:
        return "contains a NUL character, which no file name can hold"
    try:  # strict UTF-8: the config is pinned as JSON (run.json), which cannot hold a lone surrogate
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds {text[exc.start]!r}, a lone surrogate (or a byte of a file name that is not UTF-8), "
                "which the run's JSON config cannot hold")
    if text.startswith("~") and os.path.expanduser(text) == text:
        return f"starts with '{text.split('/')[0]}', which names no user's home folder"
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX:
        return f"has a file or folder name of {longest} bytes, more than the {NAME_MAX} a name may have"
    if len(raw) >= PATH_MAX:
        return f"is {len(raw)} bytes long, more than the {PATH_MAX - 1} a path may have"
    return None


class PPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # --- run ---
    run: str = Field("default", description="run name: letters, digits, '_', '-', '.'")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    artifact_root: Path = Field(PROJECT_ROOT / "artifacts")
    model: str = Field(DEFAULT_MODEL, description="'smollm2' or a path to an mlx_lm model directory")
    prompts_path: Path = Field(PROJECT_ROOT / "data" / "prompts.jsonl")
    eval_prompts_path: Path = Field(PROJECT_ROOT / "data" / "eval_prompts.jsonl")

    # --- rollout ---
    batch_size: int = Field(32, ge=1, le=4096, description="prompts sampled per iteration")
    max_new_tokens: int = Field(40, ge=1, le=2048)
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    top_p: float = Field(
        1.0, gt=0.0, le=1.0,
        description="must be 1: PPO's logprobs, ratios and KL are those of the full tempered distribution, "
        "so sampling from a nucleus would make every update off-policy",
    )
    samples_per_prompt: int = Field(
        1, ge=1, le=256,
        description="responses sampled per chosen prompt (rollouts = batch_size x samples_per_prompt); "
        "grpo, dr_grpo and rloo compare the responses to one prompt, so need at least 2",
    )
    score_batch_size: int = Field(16, ge=1, le=1024, description="sequences per scoring forward pass")
    generation_batch_size: int = Field(
        64, ge=1, le=4096,
        description="responses sampled side by side (rollout and evaluation run in chunks of this many): "
        "bounds the sampler's KV cache",
    )

    # --- reward ---
    reward: str = Field(
        "vader",
        description="'vader', 'length', 'keyword:<word>[,<word>...]', 'model:<path>' (a learned reward model) or "
        "'python:<module or file.py>:<function>' (your own batched function, see ppo_core.user_reward)",
    )
    reward_norm: Literal["none", "batch", "train"] = Field(
        "none", description="learned reward models: raw score, z-score per batch, or z-score by training-set stats"
    )
    kl_coef: float = Field(0.05, ge=0.0, le=10.0)
    adaptive_kl: bool = False
    kl_target: float = Field(4.0, gt=0.0, le=1000.0, description="target mean KL per rollout, in nats (adaptive_kl)")
    kl_horizon: int = Field(
        10000, ge=1, le=10**9,
        description="adaptive_kl, counted in rollouts: each iteration of n rollouts multiplies kl_coef by "
        "1 + clip(KL/kl_target - 1, -0.2, 0.2) x n / kl_horizon (Ziegler et al. 2019)",
    )
    missing_eos_penalty: float = Field(-0.2, ge=-100.0, le=0.0, description="added to the score of responses cut at max_new_tokens")
    length_min: int = Field(8, ge=0, le=2048, description="'length' reward: shortest full-score response (tokens)")
    length_max: int = Field(24, ge=1, le=2048, description="'length' reward: longest full-score response (tokens)")

    # --- advantage ---
    advantage_estimator: Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"] = Field(
        "gae",
        description="gae: value model + GAE (PPO); grpo: score normalised within each prompt's group; dr_grpo: "
        "the same without the std division; rloo: leave-one-out baseline; reinforce_pp: batch-whitened "
        "per-token return (REINFORCE++). All but gae train no value model and skip the value phase",
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    whiten_advantages: bool = True

    # --- train ---
    ppo_epochs: int = Field(4, ge=1, le=100)
    num_minibatches: int = Field(2, ge=1, le=1024)
    policy_lr: float = Field(5e-4, gt=0.0, le=1.0, description="peak learning rate of the policy's Adam (bias-corrected)")
    value_lr: float = Field(5e-3, gt=0.0, le=1.0, description="peak learning rate of the value model's Adam (bias-corrected)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warm-up: hold the peak, or decay it linearly / on a cosine to lr_min_ratio x peak"
    )
    lr_warmup_steps: int = Field(0, ge=0, le=10**7, description="optimiser steps of linear warm-up: step s < N runs at peak x (s+1)/N")
    lr_decay_iterations: int = Field(
        100, ge=1, le=10**6,
        description="linear/cosine: iterations over which the rate decays after warm-up; it then stays at the floor",
    )
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0, description="linear/cosine: the floor, as a fraction of the peak")
    value_warmup_iterations: int = Field(
        0, ge=0, le=10**6, description="train only the value model in the first N iterations (the policy stays put)"
    )
    clip_range: float = Field(0.2, gt=0.0, le=10.0)
    value_clip_range: float = Field(0.2, gt=0.0, le=1000.0)
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, gt=0.0, le=1000.0)
    lora_rank: int = Field(8, ge=1, le=256)
    lora_alpha: float = Field(16.0, gt=0.0, le=1024.0)
    lora_layers: int = Field(
        8, ge=1, le=1000,
        description="adapters on the last N transformer layers; the layers below are frozen, so their "
        "activations are computed once per batch and shared by policy, reference and value",
    )
    lora_targets: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the base model's weights and activations: 'auto' is float32 on the CPU (half precision "
        "is several times slower there) and bfloat16 on a GPU; adapters, heads, log-softmax, losses and "
        "optimiser state stay float32 either way. 'auto' is resolved on the machine that computes: set it "
        "explicitly to reproduce a run's bits on another kind of device",
    )

    # --- evaluate ---
    eval_size: int = Field(32, ge=0, le=100000, description="held-out prompts scored per iteration (0 = skip)")
    eval_max_new_tokens: int = Field(40, ge=1, le=2048)
    eval_temperature: float = Field(0.0, ge=0.0, le=10.0, description="0 = greedy")

    @field_validator("run")
    @classmethod
    def _run_name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("prompts_path", "eval_prompts_path", "model", "artifact_root", mode="before")
    @classmethod
    def _file_name_given(cls, v: Any) -> Any:
        # before conversion too: Path("") would be "." (the working folder), which nobody means by an empty value
        problem = path_problem(v) if isinstance(v, (str, Path)) else None
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("prompts_path", "eval_prompts_path", "model", "artifact_root")
    @classmethod
    def _file_name(cls, v: Any) -> Any:
        problem = path_problem(v)  # what a conversion made of it (bytes become text)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("artifact_root")
    @classmethod
    def _root(cls, v: Path) -> Path:
        problem = artifact_root_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("reward")
    @classmethod
    def _reward_spec(cls, v: str) -> str:
        # the file a learned reward model or a python: reward's .py is read from
        target = v.removeprefix("model:") if v.startswith("model:") else v.removeprefix("python:").rpartition(":")[0]
        problem = path_problem(target) if v.startswith("model:") or target.endswith(".py") else None
        if problem:
            raise ValueError(f"the file of {v!r} {problem}")
        if v in ("vader", "length") or re.match(r"^keyword:\w[\w,]*$", v) or v.startswith("model:"):
            return v
        if v.startswith("python:"):
            from ppo_core.user_reward import normalize_spec

            return normalize_spec(v)
        raise ValueError(
            "must be 'vader', 'length', 'keyword:<word>[,<word>...]', 'model:<path>' or 'python:<module or file.py>:<function>'"
        )

    @field_validator("top_p")
    @classmethod
    def _full_distribution(cls, v: float) -> float:
        if v < 1.0:
            raise ValueError(
                "top_p < 1 is refused: the nucleus filter would make the sampled tokens come from a different "
                "distribution than the one PPO scores, ratios and KL are computed under (off-policy, with a biased "
                "KL); lower the temperature instead"
            )
        return v

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        # --set lora_targets=q_proj,v_proj as well as a JSON list
        return tuple(t.strip() for t in v.split(",") if t.strip()) if isinstance(v, str) else v

    @field_validator("lora_targets")
    @classmethod
    def _targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        allowed = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        bad = set(v) - allowed
        if not v or bad:
            raise ValueError(f"must be a non-empty subset of {sorted(allowed)}; unknown: {sorted(bad)}")
        return tuple(v)

    @model_validator(mode="after")
    def _consistent(self) -> PPOConfig:
        if self.num_minibatches > self.rollouts_per_iteration:
            raise ValueError(
                f"num_minibatches ({self.num_minibatches}) must be <= the rollouts per iteration "
                f"(batch_size x samples_per_prompt = {self.rollouts_per_iteration})"
            )
        if self.advantage_estimator in GROUP_ESTIMATORS and self.samples_per_prompt < 2:
            raise ValueError(
                f"advantage_estimator '{self.advantage_estimator}' compares the responses to one prompt: "
                f"samples_per_prompt must be >= 2 (got {self.samples_per_prompt})"
            )
        if self.value_warmup_iterations and not self.uses_critic:
            raise ValueError(
                f"value_warmup_iterations ({self.value_warmup_iterations}) needs a value model, but "
                f"advantage_estimator '{self.advantage_estimator}' trains none; use 'gae' or set it to 0"
            )
        if self.length_min > self.length_max:
            raise ValueError(f"length_min ({self.length_min}) must be <= length_max ({self.length_max})")
        return self

    # --- derived ---
    @property
    def rollouts_per_iteration(self) -> int:
        return self.batch_size * self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        """Only GAE needs a value model: the critic-free estimators skip the value phase and loss."""
        return self.advantage_estimator == "gae"

    @property
    def steps_per_iteration(self) -> int:
        """Optimiser steps per adapter per iteration."""
        return self.ppo_epochs * self.num_minibatches

    @property
    def layout(self) -> RunLayout:
        """Where this run's files live (``ppo_core.layout``)."""
        return RunLayout(self.artifact_root, self.run)

    @property
    def reward_source_file(self) -> Path | None:
        """The user's reward function's source file for ``reward=python:...``, else None."""
        if not self.reward.startswith("python:"):
            return None
        from ppo_core.user_reward import source_file

        return source_file(self.reward)

    @property
    def reward_model_file(self) -> Path | None:
        """The learned reward model's file for ``reward=model:<path>``, else None."""
        return Path(self.reward.removeprefix("model:")) if self.reward.startswith("model:") else None

    def to_json_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())

    def training_hash(self) -> str:
        """Hash of every field that changes what a run computes (not its name or location).

        A field added after runs existed is left out while it holds its default
        (the behaviour those runs had), so they resume with their caches intact.
        """
        d = self.to_json_dict()
        for k in ("run", "artifact_root", *EXECUTION_ONLY):
            d.pop(k)
        for k in ADDED_FIELDS:
            if d.get(k) == PPOConfig.model_fields[k].default:
                d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# the PPOConfig fields ``ppo reward-model --set`` may change: the ones that shape the reward model it trains
REWARD_MODEL_FIELDS = ("artifact_root", "dtype", "lora_alpha", "lora_layers", "lora_rank", "lora_targets", "model",
                       "score_batch_size", "seed")


class RewardModelSettings(BaseModel):
    """How ``ppo reward-model`` trains a reward model; base model, LoRA layout and seed come from PPOConfig."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    name: str = Field("rm", description="file name of the saved reward model (under the artifact root's reward models)")
    data: Path = Field(PROJECT_ROOT / "data" / "preferences.jsonl", description="JSONL/Parquet with prompt, chosen, rejected")
    epochs: int = Field(2, ge=1, le=1000)
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1, le=4096, description="preference pairs per optimiser step")
    eval_fraction: float = Field(0.2, ge=0.01, le=0.9, description="share of prompts held out for accuracy")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @classmethod
    def build(cls, **fields: Any) -> RewardModelSettings:
        """Validated settings; an invalid value raises ConfigError naming the field."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ConfigError(_format_error(exc)) from None


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        got = repr(e.get("input"))
        got = got if len(got) <= 200 else f"{got[:150]}… ({len(got)} characters)"  # a huge value stays readable
        lines.append(f"config field '{field}': {msg} (got {got})")
    return "; ".join(lines)


def parse_override(item: str) -> tuple[str, Any]:
    """'key=value' -> (key, value); the value is read as JSON when it parses, else as text."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value")
    key, raw = item.split("=", 1)
    try:
        value: Any = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, an integer beyond Python's digit limit, nesting too deep
        value = raw
    return key.strip(), value


def check_known(data: dict[str, Any], known: Iterable[str], what: str = "config field") -> None:
    """Refuse keys not in ``known``, suggesting the closest known one (a typo) or else listing them all."""
    known = sorted(known)
    unknown = sorted(set(data) - set(known), key=str)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6) if isinstance(key, str) else []
        # repr: a key holding a control character or lone surrogate stays one printable line
        hints.append(f"unknown {what} {str(key)!r}" + (f": did you mean '{close[0]}'?" if close else ""))
    if any("did you mean" not in h for h in hints):
        hints.append(f"known: {', '.join(known)}")
    raise ConfigError("; ".join(hints))


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
) -> PPOConfig:
    """Build a PPOConfig from an optional TOML/JSON file plus overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a table/object of config fields")
        data = data.get("ppo", data)
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: 'ppo' must be a table/object of config fields")
        data = dict(data)
    if isinstance(overrides, list):
        overrides = dict(parse_override(o) for o in overrides)
    data.update(overrides or {})
    check_known(data, PPOConfig.model_fields)
    try:
        return PPOConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
