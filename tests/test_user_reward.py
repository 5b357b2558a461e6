"""reward=python:<module or file>:<function>: the user's own batched reward, its contract and its errors."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from ppo_core import phases as P
from ppo_core import pipeline
from ppo_core.config import PROJECT_ROOT, ConfigError, load_config
from ppo_core.rewards import RewardError, make_reward, score_responses
from ppo_core.runs import check_inputs
from ppo_core.tables import read_table

EXAMPLE = PROJECT_ROOT / "examples" / "arithmetic"


def test_the_shipped_example_checks_the_answer():
    fn = make_reward(f"python:{EXAMPLE / 'reward.py'}:exact_sum", 0, 1)
    prompts = ["What is 2 + 3? Reply with the number only."] * 4
    scores = score_responses(fn, prompts, ["5", "The answer is 5.", "6", "five"], np.array([1, 4, 1, 1]))
    np.testing.assert_array_equal(scores, [1.0, 1.0, 0.2, 0.0])
    cfg = load_config(None, {"reward": "python:examples/arithmetic/reward.py:exact_sum",
                             "prompts_path": EXAMPLE / "prompts.jsonl", "eval_prompts_path": EXAMPLE / "eval_prompts.jsonl"})
    check_inputs(cfg)
    assert cfg.reward == f"python:{(EXAMPLE / 'reward.py').resolve()}:exact_sum"  # absolute: the same file on every worker


def test_a_module_on_the_python_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards").mkdir()
    (tmp_path / "my_rewards" / "__init__.py").write_text("")
    (tmp_path / "my_rewards" / "polite.py").write_text(
        "def please(prompts, responses):\n    return [float('please' in r.lower()) for r in responses]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, {"reward": "python:my_rewards.polite:please"})
    check_inputs(cfg)
    assert cfg.reward_source_file == (tmp_path / "my_rewards" / "polite.py").resolve()
    scores = score_responses(make_reward(cfg.reward, 0, 1), ["a", "b"], ["Please sit", "sit"], np.array([2, 1]))
    np.testing.assert_array_equal(scores, [1.0, 0.0])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("python:nothing", r"config field 'reward': .*python:<module>:<function>"),
        ("python:has spaces.py:f", None),  # a file name may hold spaces; it just must exist
        ("python:1bad.module:f", r"python:<module>:<function>"),
        ("python:my_rewards.py:not-a-name", r"python:<module>:<function>"),
    ],
)
def test_malformed_specs_are_refused_at_config_time(spec, message):
    if message is None:
        load_config(None, {"reward": spec})
    else:
        with pytest.raises(ConfigError, match=message):
            load_config(None, {"reward": spec})


def test_missing_code_fails_before_any_model_loads(tmp_path):
    (tmp_path / "r.py").write_text("def other(prompts, responses):\n    return [0.0] * len(responses)\n")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    cases = {
        f"python:{tmp_path / 'missing.py'}:f": r"reward file .*missing.py does not exist",
        f"python:{tmp_path / 'r.py'}:score": r"r.py' has no function 'score'",
        f"python:{tmp_path / 'broken.py'}:f": r"importing .*broken.py' raised ModuleNotFoundError",
        "python:no_such_pkg.rewards:f": r"module 'no_such_pkg.rewards' is not importable|cannot find module",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_inputs(load_config(None, {"reward": spec, "artifact_root": tmp_path / "art"}))


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise KeyError('label')", r"reward function 'bad.py:score' raised KeyError: 'label'"),
        ("return [1.0]", r"'bad.py:score' returned shape \(1,\), expected \(3,\)"),
        ("return [0.0, float('nan'), 1.0]", r"'bad.py:score' returned 1 non-finite score\(s\), first at rollout 1"),
        ("return ['high', 'low', 'mid']", r"'bad.py:score' raised ValueError"),
    ],
)
def test_a_misbehaving_function_is_named_in_the_error(tmp_path, body, message):
    (tmp_path / "bad.py").write_text(f"def score(prompts, responses):\n    {body}\n")
    fn = make_reward(f"python:{tmp_path / 'bad.py'}:score", 0, 1)
    with pytest.raises(RewardError, match=message):
        score_responses(fn, ["p"] * 3, ["a", "b", "c"], np.array([1, 1, 1]))


def test_editing_the_reward_code_recomputes_the_rewards(tiny_cfg, tmp_path):
    code = tmp_path / "r.py"
    code.write_text("def score(prompts, responses):\n    return [len(r) / 100 for r in responses]\n")
    cfg = tiny_cfg(reward=f"python:{code}:score", eval_size=2)
    results = pipeline.run(cfg, 1)[1]
    ro, sa = (next(r for r in results if r["phase"] == p) for p in ("rollout", "attribute"))
    args = (pipeline.output(ro, "rollouts"), pipeline.output(sa, "sa_pairs"))
    assert P.reward(cfg, 1, *args).cached
    code.write_text("def score(prompts, responses):\n    return [-1.0 for r in responses]\n")
    again = P.reward(cfg, 1, *args)
    assert not again.cached
    last = pl.from_arrow(read_table(again.path("rewards"))).group_by("rollout_id").agg(pl.col("score").last()).sort("rollout_id")
    cut = np.array(read_table(args[0]).column("finish_reason").to_pylist()) == "length"
    np.testing.assert_allclose(last["score"].to_numpy(), -1.0 + cfg.missing_eos_penalty * cut, rtol=1e-6)


def test_an_edited_module_is_reloaded_in_a_long_lived_process(tmp_path, monkeypatch):
    """A worker that imported the module before the edit scores with the edited code (the one the cache key hashed)."""
    (tmp_path / "edited_reward.py").write_text("def score(prompts, responses):\n    return [1.0] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "python:edited_reward:score"
    assert score_responses(make_reward(spec, 0, 1), ["p"], ["r"], np.array([1]))[0] == 1.0
    (tmp_path / "edited_reward.py").write_text("def score(prompts, responses):\n    return [2.0] * len(responses)\n")
    assert score_responses(make_reward(spec, 0, 1), ["p"], ["r"], np.array([1]))[0] == 2.0
