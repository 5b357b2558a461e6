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

from ppo_core.runs import parse_holder_line


def final_state(previous_holder: str, why: str) -> State:
    """The state a flow run named in the lock's ``previous_holder`` line ended in, as the lock tells it."""
    holder, outcome = parse_holder_line(previous_holder)
    if outcome is None:
        return Crashed(message=f"its process ({previous_holder}) died holding the run's lock; {why}")
    late = f"its process ({holder}) finished while the Prefect server could not be told; {why}"
    if outcome == "completed":
        return Completed(message=late)
    return Failed(message=f"{outcome.removeprefix('failed: ')} ({late})")


def record_final(client, flow_run_id: str, state: State):
    """Set ``state`` on a flow run Prefect still shows unfinished; the flow run, or None when it had ended or is
    unknown to this server. ``client``: Prefect's sync client."""
    from uuid import UUID

    from prefect.exceptions import ObjectNotFound

    try:
        run = client.read_flow_run(UUID(flow_run_id))
    except ObjectNotFound:  # another Prefect server, or deleted
        return None
    if run.state is None or run.state.is_final():
        return None
    client.set_flow_run_state(run.id, state, force=True)
    return run


def settle_previous(previous_holder: str, why: str) -> None:
    """Record the final state of the flow run named in ``previous_holder``, if Prefect still shows it unfinished."""
    from prefect.client.orchestration import get_client

    found = re.search(r"flow run ([0-9a-f-]{36})", parse_holder_line(previous_holder)[0])
    if found is None:
        return
    state = final_state(previous_holder, why)
    with get_client(sync_client=True) as client:
        if (run := record_final(client, found.group(1), state)) is not None:
            get_run_logger().warning(f"marked {run.name} {state.type.value}: {state.message}")
