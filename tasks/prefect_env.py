"""Prefect settings that must be in the environment before `import prefect`: the one place they live.

Imported first by ``tasks`` (and so by ``flows``), applied to the children
``ppo serve`` starts, and used by the test fixtures.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PREFECT_DEFAULTS = {
    # The ephemeral API server takes 15-35 s to start on a 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LOG_PRINTS": "true",
    # ppo_core.progress: a long phase's progress in the terminal and in the task run's logs
    "PREFECT_LOGGING_EXTRA_LOGGERS": "ppo_core",
}


def apply_defaults(env: MutableMapping[str, str] = os.environ) -> MutableMapping[str, str]:
    """Set each default in ``env`` unless the user set it already; returns ``env``."""
    for key, value in PREFECT_DEFAULTS.items():
        env.setdefault(key, value)
    return env


apply_defaults()
