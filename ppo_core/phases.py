"""The phases of one PPO iteration as plain functions over Parquet files.

Each phase: resolve inputs -> skip if its recorded outputs still match ->
compute -> write outputs atomically -> record (``ppo_core.phase_records``).
Prefect tasks wrap these one-to-one; ``ppo_core.pipeline`` wires them in order.
Inputs arrive as ``Path``s and ``Checkpoint``s; every output path comes from
the run's ``RunLayout``.

The data-parallel phases (rollout, attribute, value, evaluate) work row by row
over the batch, so each also runs on a ``Shard``: a contiguous rollout-id
range written to a part of its table, and ``merge`` concatenates the parts
into the phase's table under the phase's own cache key. All randomness is
keyed by (seed, iteration, phase, rollout id), so a shard's rows do not depend
on which process ran it or on how many shards there are (up to float rounding
of batched kernels over differently padded batches).

Iteration N-1's checkpoint is the policy/value that iteration N samples and
scores with; iteration 0's checkpoint holds the seeded initial adapters.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ppo_core.advantage import critic_free, gae
from ppo_core.config import PPOConfig
from ppo_core.layout import Checkpoint
from ppo_core.models import PPO_ADAPTERS, POLICY, VALUE, PolicyValueModel, load_policy_value_model
from ppo_core.phase_records import Compute, PhaseResult, lookup, run_phase
from ppo_core.prompts import check_prompt_lengths, context_length, load_prompts
from ppo_core.score import TRUNKS
from ppo_core.rewards import adaptive_kl_coef, make_reward, score_responses, shape_rewards
from ppo_core.tables import METRICS, SCHEMAS, read_table, write_table
from ppo_core.train import TrainData, TrainSettings, load_optimizer, make_optimizers, ppo_update, save_optimizer

# The phases of one iteration, in the order ``ppo_core.pipeline`` runs them;
# "init" runs once per run and writes iteration 0's checkpoint.
ITERATION_PHASES = ("rollout", "attribute", "reward", "value", "advantage", "train", "evaluate")
# Bump a phase's version when its code changes what it writes: old caches then miss.
# rollout and evaluate 2: sampling keyed per rollout id (shard-invariant), not per batch.
# reward 2: length without EOS, adaptive KL per rollout, learned rewards score the generated tokens.
# train 2: bias-corrected Adam. evaluate 3: token ids stored and scored.
PHASE_VERSION = {"init": 1, "rollout": 2, "attribute": 1, "reward": 2, "value": 1, "advantage": 2, "train": 2, "evaluate": 3}


def _run(
    cfg: PPOConfig, iteration: int, phase: str, inputs: dict[str, Path], compute: Compute, earlier_seconds: float = 0.0
) -> PhaseResult:
    """run_phase with the phase's code version (a shard's record name is '<phase>.part-I-of-N')."""
    return run_phase(cfg, iteration, phase, PHASE_VERSION[phase.split(".")[0]], inputs, compute, earlier_seconds)


def phase_seed(cfg: PPOConfig, iteration: int, phase: str) -> int:
    """Randomness of a whole phase is keyed by (seed, iteration, phase): resumes replay it exactly."""
    digest = hashlib.sha256(f"{cfg.seed}:{iteration}:{phase}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def phase_row_seeds(cfg: PPOConfig, iteration: int, phase: str, rows: np.ndarray) -> list[int]:
    """One seed per row (rollout id), keyed by (seed, iteration, phase, row): independent of sharding."""
    from ppo_core.generate import row_seeds

    return row_seeds(f"{cfg.seed}:{iteration}:{phase}", rows)


@dataclass(frozen=True)
class Shard:
    """Rows ``[n*index//count, n*(index+1)//count)`` of a phase's batch of n: a contiguous rollout-id range."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} is outside 0..{self.count - 1}")

    @property
    def whole(self) -> bool:
        return self.count == 1

    @property
    def label(self) -> str:
        return f"part-{self.index}-of-{self.count}"

    def rows(self, n: int) -> np.ndarray:
        return np.arange(n * self.index // self.count, n * (self.index + 1) // self.count)

    @staticmethod
    def split(count: int) -> list[Shard]:
        return [Shard(i, count) for i in range(count)]


WHOLE = Shard()


# ---------------------------------------------------------------- helpers


def model_for(cfg: PPOConfig, ckpt: Checkpoint, adapters: tuple[str, ...] = PPO_ADAPTERS) -> PolicyValueModel:
    """The shared base model with ``adapters`` loaded from checkpoint ``ckpt``."""
    model = load_policy_value_model(cfg)
    for a in adapters:
        model.load_adapter(a, ckpt.adapter(a))
    return model


def _as_table(name: str, columns: dict[str, Any]) -> pa.Table:
    """Columns of table ``name`` as Arrow, in its schema (write_table checks it again)."""
    return pa.table(columns).select(SCHEMAS[name].names).cast(SCHEMAS[name])


def _lists(table: pa.Table, column: str) -> list[list[int]]:
    return table.column(column).to_pylist()


def _scoring_inputs(
    cfg: PPOConfig, rollouts_path: Path, checkpoint: Checkpoint, adapter: str, shard: Shard
) -> tuple[pa.Table, PolicyValueModel, list[list[int]], list[list[int]]]:
    """The shard's rollouts, the model with ``adapter`` loaded, and each rollout's prompt and response token ids."""
    ro = read_table(rollouts_path)
    rows = shard.rows(ro.num_rows)
    ro = ro.slice(int(rows[0]), len(rows)) if len(rows) else ro.slice(0, 0)
    model = model_for(cfg, checkpoint, (adapter,))
    return ro, model, _lists(ro, "prompt_token_ids"), _lists(ro, "response_token_ids")


def _context_length(model: PolicyValueModel) -> int:
    return context_length(getattr(model.lm.args, "max_position_embeddings", None), model.tokenizer)


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

    return _run(cfg, 0, "init", {}, compute)


def reward_function(cfg: PPOConfig):
    """The run's reward function; a learned one shares the loaded base model."""
    if cfg.reward_model_file is not None:
        from ppo_core.reward_model import LearnedReward

        return LearnedReward(load_policy_value_model(cfg), cfg.reward_model_file, cfg, cfg.reward_norm)
    return make_reward(cfg.reward, cfg.length_min, cfg.length_max)


def _reward_inputs(cfg: PPOConfig) -> dict[str, Path]:
    """A learned reward model or the user's reward code is an input of every phase that scores: its bytes are in the cache key."""
    if cfg.reward_model_file is not None:
        return {"reward_model": cfg.reward_model_file}
    if cfg.reward_source_file is not None:
        return {"reward_code": cfg.reward_source_file}
    return {}


def _n_tokens_without_eos(lengths: np.ndarray, finish_reasons: list[str]) -> np.ndarray:
    """What the user calls a response's length: the EOS token the policy emitted is not a word of it."""
    return lengths - (np.asarray(finish_reasons) == "eos")


def trained_adapters(cfg: PPOConfig, iteration: int) -> tuple[str, ...]:
    """What iteration ``iteration`` trains: the value model alone during value warm-up, no value model without GAE."""
    if not cfg.uses_critic:
        return (POLICY,)
    if iteration <= cfg.value_warmup_iterations:
        return (VALUE,)
    return (POLICY, VALUE)


def _kl_coef_for(cfg: PPOConfig, iteration: int) -> float:
    """The KL coefficient of ``iteration``: fixed, or the adaptive controller's value."""
    if not cfg.adaptive_kl or iteration <= 1:
        return cfg.kl_coef
    prev = cfg.layout.table(iteration - 1, "rewards")
    meta = pq.read_schema(prev).metadata or {}
    prev_coef = float(meta[b"kl_coef"])
    prev_kl = float(meta[b"mean_rollout_kl"])
    # the controller counts sequences (kl_horizon is in rollouts), not the table's one row per token
    n_rollouts = pc.count_distinct(read_table(prev).column("rollout_id")).as_py()
    return adaptive_kl_coef(prev_coef, prev_kl, cfg.kl_target, n_rollouts, cfg.kl_horizon)


def reward(cfg: PPOConfig, iteration: int, rollouts_path: Path, sa_pairs_path: Path) -> PhaseResult:
    """Score each response, then shape per token: -kl_coef*KL_t, plus the score at the last token."""
    inputs = {"rollouts": rollouts_path, "sa_pairs": sa_pairs_path, **_reward_inputs(cfg)}
    if cfg.adaptive_kl and iteration > 1:
        inputs["previous_rewards"] = cfg.layout.table(iteration - 1, "rewards")

    def compute():
        ro = read_table(rollouts_path)
        kl = read_table(sa_pairs_path).column("kl").to_numpy()
        lengths = _flat_lengths(ro)
        finish = ro.column("finish_reason").to_pylist()
        raw = score_responses(
            reward_function(cfg), ro.column("prompt").to_pylist(), ro.column("response").to_pylist(),
            _n_tokens_without_eos(lengths, finish), (_lists(ro, "prompt_token_ids"), _lists(ro, "response_token_ids")),
        )
        truncated = np.asarray(finish) == "length"
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

    return _run(cfg, iteration, "reward", inputs, compute)


def advantage(cfg: PPOConfig, iteration: int, rewards_path: Path, values_path: Path | None) -> PhaseResult:
    """Per-token advantages by ``cfg.advantage_estimator`` (``values_path`` is None without a value model)."""
    if cfg.uses_critic and values_path is None:
        raise ValueError("advantage_estimator 'gae' needs the value phase's table")
    inputs = {"rewards": rewards_path, **({"values": values_path} if cfg.uses_critic else {})}

    def compute():
        rw = pl.from_arrow(read_table(rewards_path))
        if cfg.uses_critic:
            va = pl.from_arrow(read_table(values_path))
            joined = rw.join(va, on=["rollout_id", "t"], how="inner", maintain_order="left")
            if joined.height != rw.height:
                raise ValueError(f"rewards ({rw.height} rows) and values ({va.height} rows) do not cover the same tokens")
        else:
            joined = rw.with_columns(value=pl.lit(0.0, pl.Float32))
        per_rollout = joined.group_by("rollout_id", maintain_order=True).len()
        if not (per_rollout["rollout_id"].to_numpy() == np.arange(per_rollout.height)).all():
            # the estimators' grids and groups (rollout r answers prompt r // k) assume rollouts 0..n-1 in order
            raise ValueError(f"rewards of iteration {iteration} do not hold rollouts 0..{per_rollout.height - 1} in order")
        lengths = per_rollout["len"].to_numpy()
        v = joined["value"].to_numpy().astype(np.float64)
        r = joined["reward"].to_numpy().astype(np.float64)
        if cfg.uses_critic:
            res = gae(r, v, lengths, cfg.gamma, cfg.lam, cfg.whiten_advantages)
        else:
            res = critic_free(
                cfg.advantage_estimator, r, lengths, cfg.samples_per_prompt, cfg.gamma, cfg.whiten_advantages,
                kl_penalty=joined["kl_penalty"].to_numpy().astype(np.float64),
            )
        frame = joined.select("rollout_id", "t", "value").with_columns(
            td_error=pl.Series(res.td_error),
            advantage=pl.Series(res.advantage),
            whitened_advantage=pl.Series(res.whitened),
            **{"return": pl.Series(res.returns)},
        )
        path = write_table(cfg.layout.iter_dir(iteration), "advantages", frame.to_arrow())
        stats = {"advantage": float(res.advantage.mean())}
        if cfg.uses_critic:
            stats["explained_variance"] = float(1.0 - np.var(res.returns - v) / max(np.var(res.returns), 1e-12))
        return {"advantages": path}, stats

    return _run(cfg, iteration, "advantage", inputs, compute)


@dataclass(frozen=True)
class TrainJob:
    """One iteration's training, as JSON-able fields: what a rank process is handed."""

    cfg: dict[str, Any]
    iteration: int
    rollouts: str
    sa_pairs: str
    advantages: str
    checkpoint: str  # the folder of the checkpoint trained from

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


RankLauncher = Callable[[TrainJob, int], None]  # runs train_job on N ranks; raises when one fails


def _train_inputs(checkpoint: Checkpoint) -> dict[str, Path]:
    inputs = {}
    for a in PPO_ADAPTERS:  # iteration 0's checkpoint has adapters but no optimiser state yet
        inputs[f"{a}_adapter"] = checkpoint.adapter(a)
        if checkpoint.optimizer(a).is_file():
            inputs[f"{a}_optimizer"] = checkpoint.optimizer(a)
    return inputs


def train_job(job: TrainJob, group: Any = None) -> None:
    """PPO epochs over the joined tables; rank 0 (or the only process) writes the checkpoint and metrics.

    ``group`` is an ``mx.distributed`` group: each rank trains on its slice of
    every minibatch and all take the same steps (``ppo_core.train``).
    """
    cfg, iteration = PPOConfig(**job.cfg), job.iteration
    checkpoint = Checkpoint(Path(job.checkpoint))
    ro = read_table(Path(job.rollouts))
    tokens = pl.from_arrow(read_table(Path(job.sa_pairs))).join(
        pl.from_arrow(read_table(Path(job.advantages))), on=["rollout_id", "t"], how="inner", maintain_order="left"
    )
    data = TrainData(
        prompt_ids=_lists(ro, "prompt_token_ids"),
        response_ids=_lists(ro, "response_token_ids"),
        old_logprob=tokens["logprob"].to_numpy(),
        old_value=tokens["value"].to_numpy(),
        # whitened_advantage is what the loss uses: the advantage itself wherever whitening is off
        advantage=tokens["whitened_advantage"].to_numpy(),
        returns=tokens["return"].to_numpy(),
    )
    if len(data.old_logprob) != int(data.lengths.sum()):
        raise ValueError("sa_pairs and advantages do not cover every generated token")
    model = model_for(cfg, checkpoint)
    optimizers = make_optimizers(cfg)
    for name, path in _train_inputs(checkpoint).items():
        if name.endswith("_optimizer"):
            load_optimizer(optimizers[name.removesuffix("_optimizer")], path)
    rng = np.random.default_rng(phase_seed(cfg, iteration, "train"))
    settings = TrainSettings.from_config(cfg, trained_adapters(cfg, iteration))
    rows = ppo_update(model, data, settings, optimizers, rng, group)
    if group is not None and group.rank() != 0:
        return
    # an adapter this iteration does not train is carried over unchanged, with its optimiser state
    ckpt = cfg.layout.checkpoint(iteration)
    for a in PPO_ADAPTERS:
        model.save_adapter(a, ckpt.adapter(a))
        save_optimizer(optimizers[a], ckpt.optimizer(a))
    metrics = pl.DataFrame(rows)
    untrained = [pl.lit(None, pl.Float32).alias(n) for n in METRICS.names if n not in metrics.columns]
    write_table(cfg.layout.iter_dir(iteration), "metrics", metrics.with_columns(untrained).to_arrow())


def train(
    cfg: PPOConfig,
    iteration: int,
    rollouts_path: Path,
    sa_pairs_path: Path,
    advantages_path: Path,
    checkpoint: Checkpoint,
    ranks: int = 1,
    launch: RankLauncher | None = None,
) -> PhaseResult:
    """PPO epochs over the joined tables; writes iteration N's checkpoint and metrics table.

    With ``ranks`` > 1 the epochs run data-parallel on that many processes,
    started by ``launch`` (default: ``ppo_core.ranks.launch_local``, on this
    machine). The result does not depend on the number of ranks up to float
    rounding, so it is reused whatever the ranks of a later run.
    """
    inputs = {"rollouts": rollouts_path, "sa_pairs": sa_pairs_path, "advantages": advantages_path, **_train_inputs(checkpoint)}

    def compute():
        job = TrainJob(cfg.to_json_dict(), iteration, str(rollouts_path), str(sa_pairs_path), str(advantages_path), str(checkpoint.dir))
        if ranks <= 1:
            train_job(job)
        else:
            from ppo_core.ranks import check_ranks, launch_local

            check_ranks(cfg, ranks)
            (launch or launch_local)(job, ranks)
        ckpt = cfg.layout.checkpoint(iteration)
        paths = {}
        for a in PPO_ADAPTERS:
            paths[f"{a}_adapter"], paths[f"{a}_optimizer"] = ckpt.adapter(a), ckpt.optimizer(a)
        paths["metrics"] = cfg.layout.table(iteration, "metrics")
        metrics = pl.from_arrow(read_table(paths["metrics"]))
        last_epoch = metrics.filter(pl.col("epoch") == metrics["epoch"].max())
        keys = ["policy_loss", "value_loss", "approx_kl", "clip_fraction"] + (["entropy"] if cfg.entropy_coef > 0 else [])
        # an adapter not trained this iteration (value warm-up, critic-free) has no loss to report
        stats = {k: float(last_epoch[k].mean()) for k in keys if last_epoch[k].null_count() < last_epoch.height}
        stats["tokens"] = float(_flat_lengths(read_table(rollouts_path)).sum() * cfg.ppo_epochs)
        stats["optimizer_steps"] = float(metrics.height)
        return paths, stats

    return _run(cfg, iteration, "train", inputs, compute)


# ---------------------------------------------------------------- data-parallel phases


@dataclass(frozen=True)
class DataPhase:
    """A phase that computes its table's rows independently per rollout, so it can run sharded."""

    name: str
    table: str
    inputs: Callable[..., dict[str, Path]]  # (cfg, iteration, *args) -> the cache key's input files
    rows: Callable[..., pa.Table]  # (cfg, iteration, shard, *args) -> the shard's rows
    # (cfg, whole table) -> (table to write, stats): whole-batch work done once, after a merge
    finish: Callable[[PPOConfig, pa.Table], tuple[pa.Table, dict[str, float]]]


def _run_data_phase(spec: DataPhase, cfg: PPOConfig, iteration: int, args: tuple, shard: Shard) -> PhaseResult:
    inputs = spec.inputs(cfg, iteration, *args)

    def compute():
        rows = spec.rows(cfg, iteration, shard, *args)
        if shard.whole:
            table, stats = spec.finish(cfg, rows)
            return {spec.table: write_table(cfg.layout.iter_dir(iteration), spec.table, table)}, stats
        part = write_table(cfg.layout.part_dir(iteration, shard.label), spec.table, rows)
        return {spec.table: part}, {"rows": float(rows.num_rows)}

    name = spec.name if shard.whole else f"{spec.name}.{shard.label}"
    return _run(cfg, iteration, name, inputs, compute)


def done(phase: str, cfg: PPOConfig, iteration: int, *args: Any) -> PhaseResult | None:
    """The data phase's verified result if it already finished (whole or merged), else None."""
    spec = DATA_PHASES[phase]
    return lookup(cfg, iteration, spec.name, PHASE_VERSION[spec.name], spec.inputs(cfg, iteration, *args))


def merge(
    cfg: PPOConfig, iteration: int, phase: str, parts: list[Path], *args: Any, shard_seconds: float = 0.0
) -> PhaseResult:
    """Concatenate a data phase's shard parts (in shard order) into its table, under the phase's own cache key.

    The key is the unsharded phase's, so a finished phase is reused whatever
    the number of shards of a later run. ``shard_seconds`` (the wall time of
    the shards) is added to the phase's recorded time.
    """
    spec = DATA_PHASES[phase]

    def compute():
        table, stats = spec.finish(cfg, pa.concat_tables([read_table(p) for p in parts]))
        return {spec.table: write_table(cfg.layout.iter_dir(iteration), spec.table, table)}, stats

    return _run(cfg, iteration, spec.name, spec.inputs(cfg, iteration, *args), compute, shard_seconds)


def _rollout_inputs(cfg: PPOConfig, iteration: int, checkpoint: Checkpoint) -> dict[str, Path]:
    return {"policy_adapter": checkpoint.adapter(POLICY), "prompts": cfg.prompts_path}


def _rollout_rows(cfg: PPOConfig, iteration: int, shard: Shard, checkpoint: Checkpoint) -> pa.Table:
    from ppo_core.generate import decode_responses, generate_chunked, render_prompts

    prompts = load_prompts(cfg.prompts_path)
    # which prompts the iteration samples is a whole-batch choice; a shard takes its rows of it.
    # Rollout r answers chosen prompt r // k (k = samples_per_prompt): a group's rollouts are consecutive.
    idx = np.sort(np.random.default_rng(phase_seed(cfg, iteration, "rollout")).choice(prompts.height, cfg.batch_size, replace=False))
    rollout_ids = shard.rows(cfg.rollouts_per_iteration)
    chosen = prompts[idx[rollout_ids // cfg.samples_per_prompt]]
    model = model_for(cfg, checkpoint, (POLICY,))
    TRUNKS.clear()  # the last iteration's frozen activations: sampling needs the memory
    prompt_ids = render_prompts(model, chosen["prompt"].to_list())
    check_prompt_lengths(chosen, [len(p) for p in prompt_ids], cfg.max_new_tokens, _context_length(model), cfg.prompts_path)
    seeds = phase_row_seeds(cfg, iteration, "rollout", rollout_ids)
    gen = generate_chunked(
        model, prompt_ids, chunk=cfg.generation_batch_size, adapter=POLICY, max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, seeds=seeds, what=f"rollout of iteration {iteration}",
    )
    return _as_table("rollouts", {
        "rollout_id": rollout_ids.astype(np.int32),
        "prompt_id": chosen["prompt_id"].to_list(),
        "prompt": chosen["prompt"].to_list(),
        "response": decode_responses(model, gen.response_ids),
        "prompt_token_ids": prompt_ids,
        "response_token_ids": gen.response_ids,
        "finish_reason": gen.finish_reasons,
        "sampling_logprobs": gen.sampling_logprobs,
        "seed": seeds,
    })  # fmt: skip


def _rollout_finish(cfg: PPOConfig, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
    lengths = _flat_lengths(table)
    n_tokens = int(lengths.sum())
    eos = pc.equal(table.column("finish_reason"), "eos").to_numpy(zero_copy_only=False)
    return table, {"tokens": n_tokens, "response_length": n_tokens / table.num_rows, "eos_fraction": float(eos.mean())}


def _attribute_inputs(cfg: PPOConfig, iteration: int, rollouts_path: Path, checkpoint: Checkpoint) -> dict[str, Path]:
    return {"rollouts": rollouts_path, "policy_adapter": checkpoint.adapter(POLICY)}


def _attribute_rows(cfg: PPOConfig, iteration: int, shard: Shard, rollouts_path: Path, checkpoint: Checkpoint) -> pa.Table:
    """Per-token policy and reference logprobs, KL and entropy (one forward per model)."""
    from ppo_core.score import score_logprobs

    ro, model, p_ids, r_ids = _scoring_inputs(cfg, rollouts_path, checkpoint, POLICY, shard)
    (logprob, entropy), (ref_logprob, _) = score_logprobs(
        model, p_ids, r_ids, adapters=(POLICY, None), entropy=(True, False),
        temperature=cfg.temperature, batch_size=cfg.score_batch_size,
    )
    frame = _token_frame(ro)
    return frame.with_columns(
        token=_token_texts(model, frame["token_id"]),
        logprob=pl.Series(logprob),
        ref_logprob=pl.Series(ref_logprob),
        kl=pl.Series(logprob - ref_logprob),
        entropy=pl.Series(entropy),
    ).to_arrow()


def _attribute_finish(cfg: PPOConfig, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
    return table, {"tokens": table.num_rows, "entropy": float(table.column("entropy").to_numpy().mean())}


def _value_inputs(cfg: PPOConfig, iteration: int, rollouts_path: Path, checkpoint: Checkpoint) -> dict[str, Path]:
    return {"rollouts": rollouts_path, "value_adapter": checkpoint.adapter(VALUE)}


def _value_rows(cfg: PPOConfig, iteration: int, shard: Shard, rollouts_path: Path, checkpoint: Checkpoint) -> pa.Table:
    from ppo_core.score import score_values

    ro, model, p_ids, r_ids = _scoring_inputs(cfg, rollouts_path, checkpoint, VALUE, shard)
    values = score_values(model, p_ids, r_ids, batch_size=cfg.score_batch_size)
    return _token_frame(ro).select("rollout_id", "t").with_columns(value=pl.Series(values)).to_arrow()


def _value_finish(cfg: PPOConfig, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
    return table, {"value": float(table.column("value").to_numpy().mean())}


def _evaluate_inputs(cfg: PPOConfig, iteration: int, checkpoint: Checkpoint) -> dict[str, Path]:
    return {"policy_adapter": checkpoint.adapter(POLICY), "eval_prompts": cfg.eval_prompts_path, **_reward_inputs(cfg)}


def _evaluate_rows(cfg: PPOConfig, iteration: int, shard: Shard, checkpoint: Checkpoint) -> pa.Table:
    """Answers to the shard's held-out prompts; scored in ``_evaluate_finish`` over the whole set."""
    from ppo_core.generate import decode_responses, generate_chunked, render_prompts

    all_prompts = load_prompts(cfg.eval_prompts_path).head(cfg.eval_size)
    rows = shard.rows(all_prompts.height)
    if not len(rows):  # more shards than held-out prompts: this one has none
        return SCHEMAS["eval"].empty_table()
    prompts = all_prompts[rows]
    model = model_for(cfg, checkpoint, (POLICY,))
    prompt_ids = render_prompts(model, prompts["prompt"].to_list())
    check_prompt_lengths(prompts, [len(p) for p in prompt_ids], cfg.eval_max_new_tokens, _context_length(model), cfg.eval_prompts_path)
    gen = generate_chunked(
        model, prompt_ids, chunk=cfg.generation_batch_size, adapter=POLICY, max_new_tokens=cfg.eval_max_new_tokens,
        temperature=cfg.eval_temperature, seeds=phase_row_seeds(cfg, iteration, "evaluate", rows),
        what=f"evaluation of iteration {iteration}",
    )
    return _as_table("eval", {
        "prompt_id": prompts["prompt_id"].to_list(),
        "prompt": prompts["prompt"].to_list(),
        "response": decode_responses(model, gen.response_ids),
        "response_tokens": _n_tokens_without_eos(np.array([len(r) for r in gen.response_ids]), gen.finish_reasons).astype(np.int32),
        "finish_reason": gen.finish_reasons,
        "score": np.full(len(rows), np.nan),
        "prompt_token_ids": prompt_ids,
        "response_token_ids": gen.response_ids,
    })  # fmt: skip


def _evaluate_finish(cfg: PPOConfig, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
    """Score every answer at once: a batch-normalised reward must see the whole held-out set."""
    lengths = table.column("response_tokens").to_numpy()
    prompts, responses = table.column("prompt").to_pylist(), table.column("response").to_pylist()
    token_ids = (_lists(table, "prompt_token_ids"), _lists(table, "response_token_ids"))
    scores = score_responses(reward_function(cfg), prompts, responses, lengths, token_ids)
    table = table.set_column(table.schema.get_field_index("score"), "score", pa.array(scores, pa.float32()))
    return table, {"eval_score": float(scores.mean()), "eval_response_length": float(lengths.mean())}


DATA_PHASES = {
    spec.name: spec
    for spec in (
        DataPhase("rollout", "rollouts", _rollout_inputs, _rollout_rows, _rollout_finish),
        DataPhase("attribute", "sa_pairs", _attribute_inputs, _attribute_rows, _attribute_finish),
        DataPhase("value", "values", _value_inputs, _value_rows, _value_finish),
        DataPhase("evaluate", "eval", _evaluate_inputs, _evaluate_rows, _evaluate_finish),
    )
}


def rollout(cfg: PPOConfig, iteration: int, checkpoint: Checkpoint, shard: Shard = WHOLE) -> PhaseResult:
    """Sample ``samples_per_prompt`` responses per chosen prompt with the policy of ``checkpoint``."""
    return _run_data_phase(DATA_PHASES["rollout"], cfg, iteration, (checkpoint,), shard)


def attribute(cfg: PPOConfig, iteration: int, rollouts_path: Path, checkpoint: Checkpoint, shard: Shard = WHOLE) -> PhaseResult:
    """Per-token policy and reference logprobs, KL and entropy."""
    return _run_data_phase(DATA_PHASES["attribute"], cfg, iteration, (rollouts_path, checkpoint), shard)


def value(cfg: PPOConfig, iteration: int, rollouts_path: Path, checkpoint: Checkpoint, shard: Shard = WHOLE) -> PhaseResult:
    """V(s_t) of the value model of ``checkpoint`` for every generated token."""
    return _run_data_phase(DATA_PHASES["value"], cfg, iteration, (rollouts_path, checkpoint), shard)


def evaluate(cfg: PPOConfig, iteration: int, checkpoint: Checkpoint, shard: Shard = WHOLE) -> PhaseResult:
    """Score the policy of ``checkpoint`` on the held-out eval prompts."""
    return _run_data_phase(DATA_PHASES["evaluate"], cfg, iteration, (checkpoint,), shard)
