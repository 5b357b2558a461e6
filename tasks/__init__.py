"""One Prefect task per PPO phase (and the reward-model training task): Parquet in, Parquet out, JSON results."""

from tasks import prefect_env  # noqa: F401  (must precede any prefect import)
