"""PPOConfig validation, file loading, overrides and the training hash."""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import json
from pathlib import Path

import pytest

from ppo_core.config import ConfigError, PPOConfig, load_config, parse_override


def test_defaults_validate():
    cfg = load_config()
    assert cfg == PPOConfig()
    assert cfg.run == "default"
    assert cfg.num_minibatches <= cfg.batch_size
    assert cfg.layout.run_dir == cfg.artifact_root / "run=default"
    assert cfg.layout.iter_dir(3) == cfg.layout.run_dir / "iter=0003"
    # the JSON dump validates back into the same config
    assert PPOConfig(**cfg.to_json_dict()) == cfg


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"policy_lr": -1}, "policy_lr"),
        ({"clip_range": 0}, "clip_range"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"run": "../x"}, "run"),
        ({"run": "a/b"}, "run"),
        ({"run": "x..y"}, "run"),
        ({"run": ""}, "run"),
        ({"batch_size": 4, "num_minibatches": 5}, "num_minibatches"),
        ({"length_min": 30, "length_max": 20}, "length_min"),
        ({"reward": "sentiment"}, "reward"),
        ({"lora_targets": ["q_proj", "nope"]}, "lora_targets"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"lerning_rate": 0.1}, "lerning_rate"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(overrides=overrides)


def test_unknown_field_from_override_strings():
    with pytest.raises(ConfigError, match="bogus_knob"):
        load_config(overrides=["bogus_knob=3"])


def test_error_message_has_the_value():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"gamma": 1.5})
    msg = str(info.value)
    assert "'gamma'" in msg and "1.5" in msg


def test_config_is_frozen():
    cfg = PPOConfig()
    with pytest.raises(Exception):
        cfg.batch_size = 3  # type: ignore[misc]
    assert cfg.batch_size == 32


def test_load_toml(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text('run = "exp1"\nbatch_size = 8\nnum_minibatches = 4\ngamma = 0.9\nreward = "length"\n')
    cfg = load_config(p)
    assert (cfg.run, cfg.batch_size, cfg.num_minibatches, cfg.gamma, cfg.reward) == ("exp1", 8, 4, 0.9, "length")
    assert cfg.lam == PPOConfig().lam  # untouched fields keep their defaults


def test_load_toml_ppo_table(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text('[ppo]\nseed = 7\nlora_targets = ["q_proj", "v_proj"]\n')
    cfg = load_config(p)
    assert cfg.seed == 7
    assert cfg.lora_targets == ("q_proj", "v_proj")


def test_load_json(tmp_path: Path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"run": "j", "kl_coef": 0.1, "adaptive_kl": True}))
    cfg = load_config(p)
    assert (cfg.run, cfg.kl_coef, cfg.adaptive_kl) == ("j", 0.1, True)


def test_file_values_validated(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text("clip_range = 0\n")
    with pytest.raises(ConfigError, match="clip_range"):
        load_config(p)


def test_overrides_beat_file(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text("batch_size = 8\nseed = 1\n")
    cfg = load_config(p, overrides=["seed=5"])
    assert (cfg.batch_size, cfg.seed) == (8, 5)


def test_override_strings_parse_json():
    cfg = load_config(
        overrides=[
            "batch_size=4",
            "reward=vader",
            "gamma=0.5",
            "whiten_advantages=false",
            'lora_targets=["q_proj"]',
            "reward=keyword:happy,joy",
            "run=my-run.v2",
        ]
    )
    assert cfg.batch_size == 4 and isinstance(cfg.batch_size, int)
    assert cfg.gamma == 0.5
    assert cfg.whiten_advantages is False
    assert cfg.lora_targets == ("q_proj",)
    assert cfg.reward == "keyword:happy,joy"  # the later override wins
    assert cfg.run == "my-run.v2"


@pytest.mark.parametrize(
    "item,expected",
    [
        ("batch_size=4", ("batch_size", 4)),
        ("reward=vader", ("reward", "vader")),
        ("gamma=0.25", ("gamma", 0.25)),
        ("adaptive_kl=true", ("adaptive_kl", True)),
        ("model=a=b", ("model", "a=b")),  # split on the first '=' only
        (" seed =3", ("seed", 3)),
        ("run=", ("run", "")),
    ],
)
def test_parse_override(item, expected):
    key, value = parse_override(item)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


def test_parse_override_needs_equals():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("batch_size")


def test_missing_file_names_it(tmp_path: Path):
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(p)


def test_malformed_toml_names_it(tmp_path: Path):
    p = tmp_path / "broken.toml"
    p.write_text("batch_size = = 3\n[unclosed\n")
    with pytest.raises(ConfigError, match="broken.toml") as info:
        load_config(p)
    assert "TOML" in str(info.value)


def test_malformed_json_names_it(tmp_path: Path):
    p = tmp_path / "broken.json"
    p.write_text('{"batch_size": 3,')
    with pytest.raises(ConfigError, match="broken.json"):
        load_config(p)


def test_non_utf8_config_names_it(tmp_path: Path):
    p = tmp_path / "latin.toml"
    p.write_bytes(b'run = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="latin.toml"):
        load_config(p)


def test_training_hash_ignores_run_and_artifact_root(tmp_path: Path):
    a = PPOConfig()
    b = PPOConfig(run="other", artifact_root=tmp_path / "elsewhere")
    assert a.training_hash() == b.training_hash()
    assert len(a.training_hash()) == 16
    assert a.training_hash() == PPOConfig().training_hash()  # deterministic


def test_training_hash_changes_with_training_fields():
    base = PPOConfig().training_hash()
    assert PPOConfig(seed=1).training_hash() != base
    assert PPOConfig(seed=2).training_hash() != PPOConfig(seed=1).training_hash()
    assert PPOConfig(clip_range=0.3).training_hash() != base
    assert PPOConfig(reward="length").training_hash() != base


def test_json_config_that_is_not_an_object(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a table/object"):
        load_config(p)


@pytest.mark.parametrize("root", ["/tmp/run=x/artifacts", "/tmp/a[1]/artifacts", "/tmp/st*r"])
def test_artifact_root_that_duckdb_would_misread(root):
    with pytest.raises(ConfigError, match="artifact_root"):
        load_config(overrides={"artifact_root": root})
