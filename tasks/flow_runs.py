"""Prefect bookkeeping of flow runs whose process is gone: their true final state.

A flow run can stay RUNNING in the Prefect server forever in two ways: its
process was killed (it died holding the run's lock), or it finished while the
Prefect server was away, so the final state it sent never arrived (it left
``released (completed|failed: …)`` in the lock). The next flow run of the same
PPO run reads the previous holder's line from the lock and records the state.

In an importable module, not in ``flows/ppo.py``: a deployment loads that file
as a script module (``ppo``), and a function of it that a flow refers to would
be pickled by reference to a module Ray workers cannot import.
"""

from __future__ import annotations

import re

from prefect import get_run_logger
from prefect.states import Completed, Crashed, Failed, State

from ppo_core.runs import RELEASED


def final_state(previous_holder: str, why: str) -> State:
    """The state a flow run named in the lock's ``previous_holder`` line ended in, as the lock tells it."""
    released = re.match(rf"{RELEASED} \((completed|failed: (.*))\): (.*)$", previous_holder)
    if released is None:
        return Crashed(message=f"its process ({previous_holder}) died holding the run's lock; {why}")
    holder = released.group(3)
    late = f"its process ({holder}) finished while the Prefect server could not be told; {why}"
    if released.group(1) == "completed":
        return Completed(message=late)
    return Failed(message=f"{released.group(2)} ({late})")


def settle_previous(previous_holder: str, why: str) -> None:
    """Record the final state of the flow run named in ``previous_holder``, if Prefect still shows it unfinished."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    released = re.match(rf"{RELEASED} \((?:completed|failed: .*)\): (.*)$", previous_holder)
    holder = released.group(1) if released else previous_holder  # not a flow run named in a failure's text
    found = re.search(r"flow run ([0-9a-f-]{36})", holder)
    if found is None:
        return
    with get_client(sync_client=True) as client:
        try:
            gone = client.read_flow_run(UUID(found.group(1)))
        except ObjectNotFound:  # another Prefect server, or deleted
            return
        if gone.state is not None and not gone.state.is_final():
            state = final_state(previous_holder, why)
            client.set_flow_run_state(gone.id, state, force=True)
            get_run_logger().warning(f"marked {gone.name} {state.type.value}: {state.message}")
