"""Prefect bookkeeping of flow runs: the one whose process died is marked CRASHED.

In an importable module, not in ``flows/ppo.py``: a deployment loads that file
as a script module (``ppo``), and a function of it that a flow refers to would
be pickled by reference to a module Ray workers cannot import.
"""

from __future__ import annotations

import re

from prefect import get_run_logger


def mark_crashed(previous_holder: str, why: str) -> None:
    """Mark the flow run named in a dead lock holder's line CRASHED, if Prefect still shows it unfinished.

    A flow run whose process was killed stays RUNNING in the Prefect server
    forever; the next flow run of the same PPO run finds its name in the lock.
    """
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    found = re.search(r"flow run ([0-9a-f-]{36})", previous_holder)
    if found is None:
        return
    with get_client(sync_client=True) as client:
        try:
            dead = client.read_flow_run(UUID(found.group(1)))
        except ObjectNotFound:  # another Prefect server, or deleted
            return
        if dead.state is not None and not dead.state.is_final():
            message = f"its process ({previous_holder}) died holding the run's lock; {why}"
            client.set_flow_run_state(dead.id, Crashed(message=message), force=True)
            get_run_logger().warning(f"marked {dead.name} CRASHED: {message}")
