"""Benchmark: PPO iterations at 16 prompts x 32 new tokens, 4 epochs x 2 minibatches.

Runs ``ppo_core.pipeline`` (no Prefect, no MLflow) on SmolLM2-135M in a
temporary artifact root and prints seconds per phase (median over iterations),
generated tokens/s, the peak resident memory of the process, and a profile:
per phase, the matmul work it did (``bench/flops.py``), the GFLOP/s that
achieved, and the floor (that work at this machine's measured matmul rate, or
decoding's weight reads at its memory bandwidth) as a share of the time taken.
Usage: python bench/bench_iteration.py [--iterations 3] [--batch-size 64 --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ppo_core  # noqa: F401  (OpenBLAS before mlx)
import numpy as np
from ppo_core import pipeline
from ppo_core.config import PROJECT_ROOT, PPOConfig
from ppo_core.layout import models_dir
from ppo_core.models import load_policy_value_model
from ppo_core.runtime import matmul_gflops, setup_blas
from ppo_core.tables import read_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import Shape, iteration_work, memory_bandwidth_gbs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lora-layers", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ppo-bench-"))
    models = models_dir(PROJECT_ROOT / "artifacts")  # reuse the converted model cache
    cfg = PPOConfig(
        run="bench", artifact_root=root, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        ppo_epochs=4, num_minibatches=2, eval_size=0, lora_layers=args.lora_layers,
    )
    models.mkdir(parents=True, exist_ok=True)
    models_dir(root).symlink_to(models.resolve(), target_is_directory=True)
    gflops, _ = matmul_gflops()
    t0 = time.perf_counter()
    load_policy_value_model(cfg)
    load_s = time.perf_counter() - t0
    pipeline.start(cfg)

    per_phase: dict[str, list[float]] = {}
    totals, rates = [], []
    for it in range(1, args.iterations + 1):
        t_it = time.perf_counter()
        results = pipeline.run_iteration(cfg, it)
        totals.append(time.perf_counter() - t_it)
        for r in results:
            per_phase.setdefault(r["phase"], []).append(r["seconds"])
        ro = results[0]
        rates.append(ro["stats"]["tokens"] / ro["seconds"])
        print(f"iteration {it}: {totals[-1]:.1f}s  " + "  ".join(f"{r['phase']} {r['seconds']:.2f}s" for r in results), flush=True)

    model = load_policy_value_model(cfg)
    rollouts = read_table(cfg.layout.table(args.iterations, "rollouts"))
    prompt_lens = np.array([len(x) for x in rollouts.column("prompt_token_ids").to_pylist()])
    response_lens = np.array([len(x) for x in rollouts.column("response_token_ids").to_pylist()])
    shape = Shape.of(json.loads((model.model_dir / "config.json").read_text()), cfg)
    work = iteration_work(shape, prompt_lens, response_lens, cfg)
    bandwidth = memory_bandwidth_gbs()
    profile = {}
    for phase, w in work.items():
        seconds = statistics.median(per_phase[phase])
        floor = max(w.gflop / gflops, w.gbyte / bandwidth)
        profile[phase] = {"seconds": round(seconds, 2), "gflop": round(w.gflop, 1), "gflop_per_s": round(w.gflop / seconds, 1),
                          "gbyte_read": round(w.gbyte, 1), "floor_seconds": round(floor, 2), "share_of_floor": round(floor / seconds, 2)}
    result = {
        "config": {"batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens, "ppo_epochs": 4,
                   "num_minibatches": 2, "lora_layers": cfg.lora_layers},
        "blas": {"library": setup_blas().library, "threads": setup_blas().threads, "matmul_gflops": round(gflops, 1)},
        "model_load_seconds": round(load_s, 2),
        "median_iteration_seconds": round(statistics.median(totals), 2),
        "median_phase_seconds": {k: round(statistics.median(v), 2) for k, v in per_phase.items()},
        "median_generated_tokens_per_s": round(statistics.median(rates), 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 2),
        "memory_bandwidth_gb_per_s": round(bandwidth, 1),
        "profile": profile,
    }
    print(json.dumps(result, indent=2))
    print("\n| phase | seconds | GFLOP | GFLOP/s | floor (s) | floor / time |\n|---|---|---|---|---|---|")
    for phase, row in profile.items():
        print(f"| {phase} | {row['seconds']} | {row['gflop']} | {row['gflop_per_s']} | {row['floor_seconds']} | {row['share_of_floor']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
