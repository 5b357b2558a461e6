"""Shared fixtures: a tiny random llama (fast) and config factories."""

from __future__ import annotations

from pathlib import Path

import pytest

import ppo_core  # noqa: F401  (OpenBLAS before mlx)
from flow_process import tiny_overrides
from local_servers import free_port, start_prefect_server, stop
from ppo_core.config import PPOConfig
from ppo_core.tiny import make_tiny_model
from tasks.prefect_env import apply_defaults

apply_defaults()  # Prefect's environment before any test imports prefect


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny")


VOWEL_REWARD = """
def vowel_share(prompts, responses):
    return [sum(c in "aeiou" for c in r) / max(len(r), 1) for r in responses]
"""


@pytest.fixture
def vowel_reward(tmp_path) -> str:
    """A ``python:`` reward spec that varies on the tiny model's random text (the built-ins barely do)."""
    path = tmp_path / "vowel_reward.py"
    path.write_text(VOWEL_REWARD)
    return f"python:{path}:vowel_share"


@pytest.fixture
def tiny_cfg(tiny_model_dir, tmp_path):
    """A PPOConfig factory on the tiny model with a fresh artifact root."""

    def make(**overrides) -> PPOConfig:
        return PPOConfig(**{**tiny_overrides(tiny_model_dir, tmp_path / "artifacts"), **overrides})

    return make


@pytest.fixture(scope="module")
def live_prefect_api(tmp_path_factory) -> str:
    """The URL of a real Prefect server (its own process and SQLite database) for a module's child processes:
    it outlives every flow run they kill."""
    port = free_port()
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"), port)
    yield f"http://127.0.0.1:{port}/api"
    stop(server)


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary Prefect API server for the whole session, stopped cleanly at the end."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# Screenshots and other things a person may want to look at after a test run (gitignored).
TEST_ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium():
    """Debian's headless Chromium driven by Playwright (``make test`` installs it; never a downloaded browser)."""
    import shutil

    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `make test` (it installs Debian's chromium) or apt-get install chromium")
    TEST_ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def test_artifacts() -> Path:
    TEST_ARTIFACTS.mkdir(exist_ok=True)
    return TEST_ARTIFACTS
