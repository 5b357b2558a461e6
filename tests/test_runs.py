"""Run-level guards: one trainer per run, pinned config."""

from __future__ import annotations

import pytest

from ppo_core.config import ConfigError
from ppo_core.runs import RunBusyError, pin_config, run_lock


def test_second_trainer_on_the_same_run_is_refused(tiny_cfg):
    cfg = tiny_cfg(run="busy")
    with run_lock(cfg):
        with pytest.raises(RunBusyError, match=r"run 'busy' is being trained by pid \d+"):
            with run_lock(cfg):
                pass
    with run_lock(cfg):  # released on exit
        pass
    with run_lock(tiny_cfg(run="other")), run_lock(cfg):  # different runs do not block each other
        pass


def test_pinned_config_lists_the_changed_fields(tiny_cfg):
    pin_config(tiny_cfg(run="p"))
    pin_config(tiny_cfg(run="p"))  # same config: fine
    with pytest.raises(ConfigError, match=r"changed: gamma: 1.0 -> 0.9, lam: 0.95 -> 0.9"):
        pin_config(tiny_cfg(run="p", gamma=0.9, lam=0.9))
