"""Benchmark: sampling a batch with this project's ``generate`` against mlx-lm's own ``batch_generate``.

Same process, same loaded SmolLM2 (float32, the CPU attention and SwiGLU of
``ppo_core``, which mlx-lm's model code then calls too), the same chat-templated
prompts, temperature 1, no adapter; each side samples the batch ``--repeats``
times (the first run of each is a warm-up and is dropped) and the median is
reported, in seconds and generated tokens per second. mlx-lm stops rows at
EOS as ours does; its logprobs are the untempered ones (see the README), ours
are the sampler's own.
Usage: python bench/bench_decode.py [--batch-size 16 --max-new-tokens 32 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ppo_core  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import batch_generate
from mlx_lm.sample_utils import make_sampler

from ppo_core.config import PROJECT_ROOT, PPOConfig
from ppo_core.generate import generate, render_prompts
from ppo_core.models import load_policy_value_model
from ppo_core.prompts import load_prompts


def _timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = PPOConfig(run="bench", artifact_root=PROJECT_ROOT / "artifacts")
    model = load_policy_value_model(cfg)
    prompt_ids = render_prompts(model, load_prompts(cfg.prompts_path)["prompt"].to_list()[: args.batch_size])

    def ours() -> int:
        gen = generate(model, prompt_ids, adapter=None, max_new_tokens=args.max_new_tokens, temperature=1.0,
                       seeds=list(range(len(prompt_ids))))
        return sum(map(len, gen.response_ids))

    def theirs() -> int:
        mx.random.seed(0)
        out = batch_generate(model.lm, model.tokenizer, prompt_ids, max_tokens=args.max_new_tokens,
                             sampler=make_sampler(temp=1.0), return_token_ids=True)
        return sum(map(len, out.token_ids))

    runs: dict[str, list[tuple[float, int]]] = {"ppo_core.generate": [], "mlx_lm.batch_generate": []}
    for _ in range(args.repeats + 1):  # alternated, so drift hits both alike
        runs["ppo_core.generate"].append(_timed(ours))
        runs["mlx_lm.batch_generate"].append(_timed(theirs))
    result = {
        name: {"median_seconds": round(statistics.median(s for s, _ in r[1:]), 2),
               "median_tokens_per_s": round(statistics.median(n / s for s, n in r[1:]), 1)}
        for name, r in runs.items()
    }
    print(json.dumps({"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, **result}, indent=2))


if __name__ == "__main__":
    main()
