"""Benchmark: one PPO iteration in one process vs 2 Ray workers vs 2 Ray workers + 2 training ranks.

Runs the real `ppo` flow (Prefect test server, MLflow store in a temporary
artifact root) on SmolLM2-135M, 4 epochs x 2 minibatches, no evaluation, for
``--iterations`` iterations per setting, and reports the seconds of each phase
of the last iteration (warm: models loaded, workers started) from the phase
records, the iteration's total, and the speed-up over one process.
Usage: python bench/bench_scaleout.py [--batch-size 16] [--max-new-tokens 32] [--iterations 2] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import ppo_core  # noqa: F401  (OpenBLAS before mlx)
from tasks import prefect_env  # noqa: F401

from ppo_core.config import PROJECT_ROOT, load_config
from ppo_core.layout import models_dir

PHASES = ("rollout", "attribute", "reward", "value", "advantage", "train")
SETTINGS = {"1 process": (0, 1), "2 Ray workers": (2, 1), "2 Ray workers + 2 ranks": (2, 2)}


def run_setting(name: str, workers: int, ranks: int, args: argparse.Namespace) -> dict:
    from flows.ppo import ppo

    root = Path(tempfile.mkdtemp(prefix="ppo-bench-scale-"))
    shared_models = models_dir(PROJECT_ROOT / "artifacts")
    shared_models.mkdir(parents=True, exist_ok=True)
    models_dir(root).parent.mkdir(parents=True, exist_ok=True)
    models_dir(root).symlink_to(shared_models.resolve(), target_is_directory=True)
    overrides = {"artifact_root": str(root), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                 "ppo_epochs": 4, "num_minibatches": 2, "eval_size": 0}  # fmt: skip
    t0 = time.perf_counter()
    ppo(run="bench", iterations=args.iterations, overrides=overrides, workers=workers, train_ranks=ranks)
    wall = time.perf_counter() - t0
    cfg = load_config(overrides={**overrides, "run": "bench"})
    last = args.iterations
    seconds = {p: json.loads(cfg.layout.phase_record(last, p).read_text())["seconds"] for p in PHASES}
    shutil.rmtree(root, ignore_errors=True)
    return {"setting": name, "workers": workers, "train_ranks": ranks, "phase_seconds": seconds,
            "iteration_seconds": sum(seconds.values()), "flow_wall_seconds": wall}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of: " + ", ".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from prefect.testing.utilities import prefect_test_harness

    results = []
    with prefect_test_harness(server_startup_timeout=180):
        for name in args.settings.split(","):
            workers, ranks = SETTINGS[name]
            results.append(run_setting(name, workers, ranks, args))
            print(json.dumps(results[-1]), flush=True)
    base = results[0]["iteration_seconds"] if results[0]["workers"] == 0 else None
    print(f"\n{args.batch_size} prompts x {args.max_new_tokens} tokens, iteration {args.iterations} (warm)")
    print("| setting | " + " | ".join(PHASES) + " | iteration | speed-up |")
    print("|---" * (len(PHASES) + 3) + "|")
    for r in results:
        speed = f"{base / r['iteration_seconds']:.2f}x" if base else "-"
        cells = " | ".join(f"{r['phase_seconds'][p]:.1f}" for p in PHASES)
        print(f"| {r['setting']} | {cells} | {r['iteration_seconds']:.1f} | {speed} |")
    if args.out:
        args.out.write_text(json.dumps({"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
