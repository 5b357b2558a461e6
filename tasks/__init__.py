"""One Prefect task per PPO phase: Parquet in, Parquet out, JSON results."""

from flows import _env  # noqa: F401  (must precede any prefect import)
