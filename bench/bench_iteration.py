"""Benchmark: PPO iterations at 16 prompts x 32 new tokens, 4 epochs x 2 minibatches.

Runs the ppo_core phases directly (no Prefect) on SmolLM2-135M in a temporary
artifact root and prints seconds per phase (median over iterations) and
generated tokens/s. Usage: python bench/bench_iteration.py [--iterations 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ppo_core  # noqa: F401  (OpenBLAS before mlx)
from ppo_core import phases as P
from ppo_core.config import PROJECT_ROOT, PPOConfig
from ppo_core.models import load_policy_value_model
from ppo_core.runtime import blas_state, matmul_gflops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lora-layers", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ppo-bench-"))
    models = PROJECT_ROOT / "artifacts"  # reuse the converted model cache
    cfg = PPOConfig(
        run="bench", artifact_root=root, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        ppo_epochs=4, num_minibatches=2, eval_size=0, lora_layers=args.lora_layers,
    )
    (root / "models").symlink_to((models / "models").resolve(), target_is_directory=True)
    (models / "models").mkdir(parents=True, exist_ok=True)
    gflops, _ = matmul_gflops()
    t0 = time.perf_counter()
    load_policy_value_model(cfg)
    load_s = time.perf_counter() - t0
    P.init_checkpoint(cfg)

    per_phase: dict[str, list[float]] = {}
    totals, rates = [], []
    for it in range(1, args.iterations + 1):
        ck = P.checkpoint_dir(cfg, it - 1)
        t_it = time.perf_counter()
        ro = P.rollout(cfg, it, ck)
        sa = P.attribute(cfg, it, ro.path("rollouts"), ck)
        rw = P.reward(cfg, it, ro.path("rollouts"), sa.path("sa_pairs"))
        va = P.value(cfg, it, ro.path("rollouts"), ck)
        ad = P.advantage(cfg, it, rw.path("rewards"), va.path("values"))
        tr = P.train(cfg, it, ro.path("rollouts"), sa.path("sa_pairs"), ad.path("advantages"), ck)
        totals.append(time.perf_counter() - t_it)
        for r in (ro, sa, rw, va, ad, tr):
            per_phase.setdefault(r.phase, []).append(r.seconds)
        rates.append(ro.stats["tokens"] / ro.seconds)
        print(f"iteration {it}: {totals[-1]:.1f}s  " + "  ".join(f"{r.phase} {r.seconds:.2f}s" for r in (ro, sa, rw, va, ad, tr)), flush=True)

    result = {
        "config": {"batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens, "ppo_epochs": 4,
                   "num_minibatches": 2, "lora_layers": cfg.lora_layers},
        "blas": {"library": blas_state().library, "threads": blas_state().threads, "matmul_gflops": round(gflops, 1)},
        "model_load_seconds": round(load_s, 2),
        "median_iteration_seconds": round(statistics.median(totals), 2),
        "median_phase_seconds": {k: round(statistics.median(v), 2) for k, v in per_phase.items()},
        "median_generated_tokens_per_s": round(statistics.median(rates), 1),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
