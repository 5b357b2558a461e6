"""Prefect flows: `ppo` (deployment `iterate`)."""

from flows import _env  # noqa: F401  (must precede any prefect import)
