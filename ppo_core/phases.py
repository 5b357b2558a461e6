"""The phases of one PPO iteration as plain functions over Parquet files.

Each phase: resolve inputs -> skip if its recorded outputs still match ->
compute -> write outputs atomically -> record (cache key, output hashes).
Prefect tasks wrap these one-to-one; ``ppo_core.pipeline`` wires them in order.
Inputs arrive as ``Path``s and ``Checkpoint``s; every output path comes from
the run's ``RunLayout``.

Iteration N-1's checkpoint is the policy/value that iteration N samples and
scores with; iteration 0's checkpoint holds the seeded initial adapters.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ppo_core.advantage import gae
from ppo_core.config import PPOConfig
from ppo_core.faults import failpoint
from ppo_core.layout import Checkpoint
from ppo_core.models import PPO_ADAPTERS, POLICY, VALUE, PolicyValueModel, load_policy_value_model
from ppo_core.prompts import check_prompt_lengths, load_prompts
from ppo_core.rewards import adaptive_kl_coef, make_reward, score_responses, shape_rewards
from ppo_core.tables import atomic_write_text, read_table, sha256_file, write_table
from ppo_core.train import TrainData, TrainSettings, load_optimizer, make_optimizer, ppo_update, save_optimizer

# The phases of one iteration, in the order ``ppo_core.pipeline`` runs them;
# "init" runs once per run and writes iteration 0's checkpoint.
ITERATION_PHASES = ("rollout", "attribute", "reward", "value", "advantage", "train", "evaluate")
# Bump a phase's version when its code changes what it writes: old caches then miss.
PHASE_VERSION = {phase: 1 for phase in ("init", *ITERATION_PHASES)}


@dataclass
class PhaseResult:
    """JSON-serialisable outcome of a phase (what a Prefect task returns)."""

    phase: str
    iteration: int
    outputs: dict[str, str]
    hashes: dict[str, str]
    cached: bool
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return Path(self.outputs[name])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def phase_seed(cfg: PPOConfig, iteration: int, phase: str) -> int:
    """All randomness is keyed by (seed, iteration, phase): resumes replay it exactly."""
    digest = hashlib.sha256(f"{cfg.seed}:{iteration}:{phase}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _cache_key(cfg: PPOConfig, iteration: int, phase: str, inputs: dict[str, Path]) -> str:
    payload = {
        "phase": phase,
        "version": PHASE_VERSION[phase],
        "config": cfg.training_hash(),
        "iteration": iteration,
        "inputs": {name: sha256_file(p) for name, p in sorted(inputs.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _valid_record(cfg: PPOConfig, iteration: int, phase: str, key: str) -> dict[str, Any] | None:
    path = cfg.layout.phase_record(iteration, phase)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("key") != key:
        return None
    for name, p in record["outputs"].items():
        # a cached result never hands back a path to a file that is gone or altered
        if not Path(p).is_file() or sha256_file(Path(p)) != record["hashes"][name]:
            return None
    return record


def run_phase(
    cfg: PPOConfig,
    iteration: int,
    phase: str,
    inputs: dict[str, Path],
    compute: Callable[[], tuple[dict[str, Path], dict[str, float]]],
) -> PhaseResult:
    """Reuse the phase's outputs when inputs, config and code are unchanged; else compute."""
    missing = [f"{n} ({p})" for n, p in inputs.items() if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"{phase} (iteration {iteration}) is missing its input(s): {', '.join(missing)}")
    key = _cache_key(cfg, iteration, phase, inputs)
    record = _valid_record(cfg, iteration, phase, key)
    if record is not None:
        return PhaseResult(phase, iteration, record["outputs"], record["hashes"], True, record["seconds"], record["stats"])
    t0 = time.perf_counter()
    outputs, stats = compute()
    seconds = time.perf_counter() - t0
    out = {n: str(p) for n, p in outputs.items()}
    hashes = {n: sha256_file(Path(p)) for n, p in outputs.items()}
    record = {"key": key, "outputs": out, "hashes": hashes, "seconds": seconds, "stats": stats}
    atomic_write_text(cfg.layout.phase_record(iteration, phase), json.dumps(record, indent=2, sort_keys=True))
    failpoint("phase.done")
    return PhaseResult(phase, iteration, out, hashes, False, seconds, stats)


# ---------------------------------------------------------------- helpers


def model_for(cfg: PPOConfig, ckpt: Checkpoint, adapters: tuple[str, ...] = PPO_ADAPTERS) -> PolicyValueModel:
    """The shared base model with ``adapters`` loaded from checkpoint ``ckpt``."""
    model = load_policy_value_model(cfg)
    for a in adapters:
        model.load_adapter(a, ckpt.adapter(a))
    return model


def _lists(table: pa.Table, column: str) -> list[list[int]]:
    return table.column(column).to_pylist()


def _scoring_inputs(
    cfg: PPOConfig, rollouts_path: Path, checkpoint: Checkpoint, adapter: str
) -> tuple[pa.Table, PolicyValueModel, list[list[int]], list[list[int]]]:
    """The rollouts, the model with ``adapter`` loaded, and each rollout's prompt and response token ids."""
    ro = read_table(rollouts_path)
    model = model_for(cfg, checkpoint, (adapter,))
    return ro, model, _lists(ro, "prompt_token_ids"), _lists(ro, "response_token_ids")


def _context_length(model: PolicyValueModel) -> int:
    n = getattr(model.lm.args, "max_position_embeddings", None)
    return int(n) if n else int(getattr(model.tokenizer, "model_max_length", 2048))


def _flat_lengths(rollouts: pa.Table) -> np.ndarray:
    return pc.list_value_length(rollouts.column("response_token_ids")).to_numpy()


def _token_frame(rollouts: pa.Table) -> pl.DataFrame:
    """(rollout_id, t, token_id) for every generated token, rollout-major."""
    return (
        pl.from_arrow(rollouts.select(["rollout_id", "response_token_ids"]))
        .explode("response_token_ids")
        .rename({"response_token_ids": "token_id"})
        .with_columns(pl.int_range(pl.len()).over("rollout_id").cast(pl.Int32).alias("t"))
        .select("rollout_id", "t", "token_id")
    )


def _token_texts(model: PolicyValueModel, token_ids: pl.Series) -> pl.Series:
    uniq = token_ids.unique().sort()
    texts = model.tokenizer.batch_decode([[int(t)] for t in uniq.to_list()]) if len(uniq) else []
    lookup = pl.DataFrame({"token_id": uniq, "token": pl.Series(texts, dtype=pl.String)})
    return token_ids.to_frame("token_id").join(lookup, on="token_id", how="left", maintain_order="left")["token"]


# ---------------------------------------------------------------- phases


def init_checkpoint(cfg: PPOConfig) -> PhaseResult:
    """Iteration 0's checkpoint: adapters initialised from the seed alone."""

    def compute():
        model = load_policy_value_model(cfg)
        model.reset_adapters(cfg.seed, PPO_ADAPTERS)
        ckpt = cfg.layout.checkpoint(0)
        paths = {f"{a}_adapter": ckpt.adapter(a) for a in PPO_ADAPTERS}
        for a in PPO_ADAPTERS:
            model.save_adapter(a, paths[f"{a}_adapter"])
        return paths, {}

    return run_phase(cfg, 0, "init", {}, compute)


def rollout(cfg: PPOConfig, iteration: int, checkpoint: Checkpoint) -> PhaseResult:
    inputs = {"policy_adapter": checkpoint.adapter(POLICY), "prompts": cfg.prompts_path}

    def compute():
        from ppo_core.generate import decode_responses, generate, render_prompts

        prompts = load_prompts(cfg.prompts_path)
        seed = phase_seed(cfg, iteration, "rollout")
        idx = np.sort(np.random.default_rng(seed).choice(prompts.height, cfg.batch_size, replace=False))
        chosen = prompts[idx]
        model = model_for(cfg, checkpoint, (POLICY,))
        prompt_ids = render_prompts(model, chosen["prompt"].to_list())
        check_prompt_lengths(chosen, [len(p) for p in prompt_ids], cfg.max_new_tokens, _context_length(model), cfg.prompts_path)
        gen = generate(
            model, prompt_ids, adapter=POLICY, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, top_p=cfg.top_p, seed=seed,
        )
        table = {
            "rollout_id": np.arange(len(prompt_ids), dtype=np.int32),
            "prompt_id": chosen["prompt_id"].to_list(),
            "prompt": chosen["prompt"].to_list(),
            "response": decode_responses(model, gen.response_ids),
            "prompt_token_ids": prompt_ids,
            "response_token_ids": gen.response_ids,
            "finish_reason": gen.finish_reasons,
            "sampling_logprobs": gen.sampling_logprobs,
            "seed": [seed] * len(prompt_ids),
        }
        n_tokens = sum(len(r) for r in gen.response_ids)
        path = write_table(cfg.layout.iter_dir(iteration), "rollouts", table)
        return {"rollouts": path}, {
            "tokens": n_tokens,
            "response_length": n_tokens / len(prompt_ids),
            "eos_fraction": float(np.mean([f == "eos" for f in gen.finish_reasons])),
        }

    return run_phase(cfg, iteration, "rollout", inputs, compute)


def attribute(cfg: PPOConfig, iteration: int, rollouts_path: Path, checkpoint: Checkpoint) -> PhaseResult:
    """Per-token policy and reference logprobs, KL and entropy (one forward per model)."""
    inputs = {"rollouts": rollouts_path, "policy_adapter": checkpoint.adapter(POLICY)}

    def compute():
        from ppo_core.score import score_logprobs

        ro, model, p_ids, r_ids = _scoring_inputs(cfg, rollouts_path, checkpoint, POLICY)
        (logprob, entropy), (ref_logprob, _) = score_logprobs(
            model, p_ids, r_ids, adapters=(POLICY, None), entropy=(True, False),
            temperature=cfg.temperature, batch_size=cfg.score_batch_size,
        )
        frame = _token_frame(ro)
        frame = frame.with_columns(
            token=_token_texts(model, frame["token_id"]),
            logprob=pl.Series(logprob),
            ref_logprob=pl.Series(ref_logprob),
            kl=pl.Series(logprob - ref_logprob),
            entropy=pl.Series(entropy),
        )
        path = write_table(cfg.layout.iter_dir(iteration), "sa_pairs", frame.to_arrow())
        return {"sa_pairs": path}, {"tokens": frame.height, "entropy": float(entropy.mean())}

    return run_phase(cfg, iteration, "attribute", inputs, compute)


def reward_function(cfg: PPOConfig):
    """The run's reward function; a learned one shares the loaded base model."""
    if cfg.reward_model_file is not None:
        from ppo_core.reward_model import LearnedReward

        return LearnedReward(load_policy_value_model(cfg), cfg.reward_model_file, cfg, cfg.reward_norm)
    return make_reward(cfg.reward, cfg.length_min, cfg.length_max)


def _reward_inputs(cfg: PPOConfig) -> dict[str, Path]:
    """A learned reward model is an input of every phase that scores: its bytes are in the cache key."""
    return {"reward_model": cfg.reward_model_file} if cfg.reward_model_file is not None else {}


def _kl_coef_for(cfg: PPOConfig, iteration: int) -> float:
    """The KL coefficient of ``iteration``: fixed, or the adaptive controller's value."""
    if not cfg.adaptive_kl or iteration <= 1:
        return cfg.kl_coef
    prev = cfg.layout.table(iteration - 1, "rewards")
    meta = pq.read_schema(prev).metadata or {}
    prev_coef = float(meta[b"kl_coef"])
    prev_kl = float(meta[b"mean_rollout_kl"])
    n_tokens = pq.read_metadata(prev).num_rows
    return adaptive_kl_coef(prev_coef, prev_kl, cfg.kl_target, n_tokens, cfg.kl_horizon)


def reward(cfg: PPOConfig, iteration: int, rollouts_path: Path, sa_pairs_path: Path) -> PhaseResult:
    """Score each response, then shape per token: -kl_coef*KL_t, plus the score at the last token."""
    inputs = {"rollouts": rollouts_path, "sa_pairs": sa_pairs_path, **_reward_inputs(cfg)}
    if cfg.adaptive_kl and iteration > 1:
        inputs["previous_rewards"] = cfg.layout.table(iteration - 1, "rewards")

    def compute():
        ro = read_table(rollouts_path)
        kl = read_table(sa_pairs_path).column("kl").to_numpy()
        lengths = _flat_lengths(ro)
        fn = reward_function(cfg)
        raw = score_responses(fn, ro.column("prompt").to_pylist(), ro.column("response").to_pylist(), lengths)
        truncated = np.array([f == "length" for f in ro.column("finish_reason").to_pylist()])
        scores = raw + cfg.missing_eos_penalty * truncated
        coef = _kl_coef_for(cfg, iteration)
        score_t, penalty, total = shape_rewards(kl, lengths, scores, coef)
        frame = _token_frame(ro).select("rollout_id", "t").with_columns(
            score=pl.Series(score_t), kl_penalty=pl.Series(penalty), reward=pl.Series(total)
        )
        rollout_kl = float(np.add.reduceat(kl, np.concatenate([[0], np.cumsum(lengths)[:-1]])).mean())
        # the adaptive KL controller's state travels in the file's own metadata
        meta = {"kl_coef": repr(coef), "mean_rollout_kl": repr(rollout_kl)}
        path = write_table(cfg.layout.iter_dir(iteration), "rewards", frame.to_arrow(), metadata=meta)
        return {"rewards": path}, {
            "score": float(raw.mean()),
            "shaped_score": float(scores.mean()),
            "kl": rollout_kl,
            "kl_coef": coef,
            "reward": float(total.sum() / len(lengths)),
        }

    return run_phase(cfg, iteration, "reward", inputs, compute)


def value(cfg: PPOConfig, iteration: int, rollouts_path: Path, checkpoint: Checkpoint) -> PhaseResult:
    inputs = {"rollouts": rollouts_path, "value_adapter": checkpoint.adapter(VALUE)}

    def compute():
        from ppo_core.score import score_values

        ro, model, p_ids, r_ids = _scoring_inputs(cfg, rollouts_path, checkpoint, VALUE)
        values = score_values(model, p_ids, r_ids, batch_size=cfg.score_batch_size)
        frame = _token_frame(ro).select("rollout_id", "t").with_columns(value=pl.Series(values))
        path = write_table(cfg.layout.iter_dir(iteration), "values", frame.to_arrow())
        return {"values": path}, {"value": float(values.mean())}

    return run_phase(cfg, iteration, "value", inputs, compute)


def advantage(cfg: PPOConfig, iteration: int, rewards_path: Path, values_path: Path) -> PhaseResult:
    inputs = {"rewards": rewards_path, "values": values_path}

    def compute():
        rw = pl.from_arrow(read_table(rewards_path))
        va = pl.from_arrow(read_table(values_path))
        joined = rw.join(va, on=["rollout_id", "t"], how="inner", maintain_order="left")
        if joined.height != rw.height:
            raise ValueError(f"rewards ({rw.height} rows) and values ({va.height} rows) do not cover the same tokens")
        lengths = joined.group_by("rollout_id", maintain_order=True).len()["len"].to_numpy()
        v = joined["value"].to_numpy().astype(np.float64)
        res = gae(joined["reward"].to_numpy().astype(np.float64), v, lengths, cfg.gamma, cfg.lam, cfg.whiten_advantages)
        frame = joined.select("rollout_id", "t", "value").with_columns(
            td_error=pl.Series(res.td_error),
            advantage=pl.Series(res.advantage),
            whitened_advantage=pl.Series(res.whitened),
            **{"return": pl.Series(res.returns)},
        )
        path = write_table(cfg.layout.iter_dir(iteration), "advantages", frame.to_arrow())
        explained = 1.0 - np.var(res.returns - v) / max(np.var(res.returns), 1e-12)
        return {"advantages": path}, {"advantage": float(res.advantage.mean()), "explained_variance": float(explained)}

    return run_phase(cfg, iteration, "advantage", inputs, compute)


def train(
    cfg: PPOConfig, iteration: int, rollouts_path: Path, sa_pairs_path: Path, advantages_path: Path, checkpoint: Checkpoint
) -> PhaseResult:
    """PPO epochs over the joined tables; writes iteration N's checkpoint and metrics table."""
    inputs = {"rollouts": rollouts_path, "sa_pairs": sa_pairs_path, "advantages": advantages_path}
    for a in PPO_ADAPTERS:  # iteration 0's checkpoint has adapters but no optimiser state yet
        inputs[f"{a}_adapter"] = checkpoint.adapter(a)
        if checkpoint.optimizer(a).is_file():
            inputs[f"{a}_optimizer"] = checkpoint.optimizer(a)

    def compute():
        ro = read_table(rollouts_path)
        tokens = (
            pl.from_arrow(read_table(sa_pairs_path))
            .join(pl.from_arrow(read_table(advantages_path)), on=["rollout_id", "t"], how="inner", maintain_order="left")
        )
        adv_col = "whitened_advantage" if cfg.whiten_advantages else "advantage"
        data = TrainData(
            prompt_ids=_lists(ro, "prompt_token_ids"),
            response_ids=_lists(ro, "response_token_ids"),
            old_logprob=tokens["logprob"].to_numpy(),
            old_value=tokens["value"].to_numpy(),
            advantage=tokens[adv_col].to_numpy(),
            returns=tokens["return"].to_numpy(),
        )
        if len(data.old_logprob) != int(data.lengths.sum()):
            raise ValueError("sa_pairs and advantages do not cover every generated token")
        model = model_for(cfg, checkpoint)
        optimizers = {POLICY: make_optimizer(cfg.policy_lr), VALUE: make_optimizer(cfg.value_lr)}
        for a in PPO_ADAPTERS:
            if f"{a}_optimizer" in inputs:
                load_optimizer(optimizers[a], inputs[f"{a}_optimizer"])
        rng = np.random.default_rng(phase_seed(cfg, iteration, "train"))
        rows = ppo_update(model, data, TrainSettings.from_config(cfg), optimizers, rng)
        ckpt = cfg.layout.checkpoint(iteration)
        paths = {}
        for a in PPO_ADAPTERS:
            paths[f"{a}_adapter"], paths[f"{a}_optimizer"] = ckpt.adapter(a), ckpt.optimizer(a)
            model.save_adapter(a, ckpt.adapter(a))
            save_optimizer(optimizers[a], ckpt.optimizer(a))
        metrics = pl.DataFrame(rows)
        paths["metrics"] = write_table(cfg.layout.iter_dir(iteration), "metrics", metrics.to_arrow())
        last_epoch = metrics.filter(pl.col("epoch") == metrics["epoch"].max())
        keys = ["policy_loss", "value_loss", "approx_kl", "clip_fraction"] + (["entropy"] if cfg.entropy_coef > 0 else [])
        stats = {k: float(last_epoch[k].mean()) for k in keys}
        stats["tokens"] = float(len(data.old_logprob) * cfg.ppo_epochs)
        stats["optimizer_steps"] = float(metrics.height)
        return paths, stats

    return run_phase(cfg, iteration, "train", inputs, compute)


def evaluate(cfg: PPOConfig, iteration: int, checkpoint: Checkpoint) -> PhaseResult:
    """Score the policy of ``checkpoint`` on the held-out eval prompts."""
    inputs = {
        "policy_adapter": checkpoint.adapter(POLICY),
        "eval_prompts": cfg.eval_prompts_path,
        **_reward_inputs(cfg),
    }

    def compute():
        from ppo_core.generate import decode_responses, generate, render_prompts

        prompts = load_prompts(cfg.eval_prompts_path).head(cfg.eval_size)
        model = model_for(cfg, checkpoint, (POLICY,))
        prompt_ids = render_prompts(model, prompts["prompt"].to_list())
        gen = generate(
            model, prompt_ids, adapter=POLICY, max_new_tokens=cfg.eval_max_new_tokens,
            temperature=cfg.eval_temperature, top_p=1.0, seed=phase_seed(cfg, iteration, "evaluate"),
        )
        responses = decode_responses(model, gen.response_ids)
        lengths = np.array([len(r) for r in gen.response_ids])
        fn = reward_function(cfg)
        scores = score_responses(fn, prompts["prompt"].to_list(), responses, lengths)
        table = {
            "prompt_id": prompts["prompt_id"].to_list(),
            "prompt": prompts["prompt"].to_list(),
            "response": responses,
            "response_tokens": lengths.astype(np.int32),
            "finish_reason": gen.finish_reasons,
            "score": scores,
        }
        path = write_table(cfg.layout.iter_dir(iteration), "eval", table)
        return {"eval": path}, {"eval_score": float(scores.mean()), "eval_response_length": float(lengths.mean())}

    return run_phase(cfg, iteration, "evaluate", inputs, compute)

