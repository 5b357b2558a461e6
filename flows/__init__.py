"""Prefect flows `ppo` (deployment `iterate`) and `reward-model`, the `ppo` CLI and `ppo serve`."""

from tasks import prefect_env  # noqa: F401  (must precede any prefect import)
