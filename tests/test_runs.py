"""Run-level guards: one trainer per run, pinned config."""

from __future__ import annotations

import os
import socket

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


def test_the_lock_names_its_holder_while_held_and_hands_how_it_ended_to_the_next(tiny_cfg):
    cfg = tiny_cfg(run="heir")
    me = f"pid {os.getpid()} on host {socket.gethostname()}"
    with run_lock(cfg, owner="flow run 1") as earlier:
        assert earlier == [] and cfg.layout.lock.read_text() == f"{me}, flow run 1"
    assert cfg.layout.lock.read_text() == f"released (completed): {me}, flow run 1"
    with pytest.raises(ValueError), run_lock(cfg, owner="flow run 2") as earlier:
        assert earlier == [f"released (completed): {me}, flow run 1"]
        earlier.clear()  # recorded by this holder: not handed on
        raise ValueError("bad\nthing")
    assert cfg.layout.lock.read_text() == f"released (failed: ValueError: bad thing): {me}, flow run 2"
    cfg.layout.lock.write_text("pid 4242 on host gone, flow run 3")  # what a killed holder leaves
    with run_lock(cfg) as earlier:  # a holder that records nothing (ppo sync, pipeline.run) hands it on
        assert earlier == ["pid 4242 on host gone, flow run 3"]
        assert cfg.layout.lock.read_text() == f"{me}\npid 4242 on host gone, flow run 3"
    with run_lock(cfg, owner="flow run 4") as earlier:
        assert earlier == ["pid 4242 on host gone, flow run 3"]
    # the line of a holder without a flow run is not handed on; the unrecorded one still is
    assert cfg.layout.lock.read_text() == f"released (completed): {me}, flow run 4\npid 4242 on host gone, flow run 3"


def test_a_busy_run_names_its_holder_and_not_a_predecessors_release(tiny_cfg):
    import fcntl

    cfg = tiny_cfg(run="window")
    cfg.layout.lock.parent.mkdir(parents=True, exist_ok=True)
    cfg.layout.lock.write_text("released (completed): pid 1 on host h, flow run 0")
    with open(cfg.layout.lock) as fh:  # a holder that has the lock but has not written its name yet
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(RunBusyError, match="being trained by another process"):
            with run_lock(cfg):
                pass


def test_temporary_files_of_a_killed_process_are_removed_when_the_run_resumes(tiny_cfg):
    from ppo_core import pipeline

    cfg = tiny_cfg(run="tmp")
    pipeline.run(cfg, 1)
    stale = [cfg.layout.checkpoint(1).dir / ".policy_adapter.k3j1x.tmp.safetensors",
             cfg.layout.iter_dir(1) / ".rollouts.8f2a.tmp.parquet", cfg.layout.iter_dir(1) / "phases" / ".train.q1.tmp.json"]
    for p in stale:
        p.write_bytes(b"half written")
    kept = cfg.layout.iter_dir(1) / "notes.tmp"  # not one of ours: left alone
    kept.write_text("mine")
    before = {p: p.read_bytes() for p in cfg.layout.run_dir.rglob("*.parquet") if not p.name.startswith(".")}
    pipeline.run(cfg, 1)
    assert not any(p.exists() for p in stale) and kept.exists()
    assert all(p.read_bytes() == b for p, b in before.items())  # nothing finished was touched


def test_until_names_the_last_iteration_and_refuses_one_already_passed(tiny_cfg):
    from ppo_core.pipeline import last_iteration

    cfg = tiny_cfg(run="until")
    assert last_iteration(cfg, first=1, iterations=3, until=None) == 3
    assert last_iteration(cfg, first=4, iterations=3, until=None) == 6
    assert last_iteration(cfg, first=3, iterations=3, until=5) == 5  # a re-run after a crash in iteration 3
    assert last_iteration(cfg, first=6, iterations=3, until=5) == 5  # everything done: only the bookkeeping
    with pytest.raises(ConfigError, match=r"parameter 'until': run 'until' has finished iteration 5 already \(got until=2\)"):
        last_iteration(cfg, first=6, iterations=3, until=2)
