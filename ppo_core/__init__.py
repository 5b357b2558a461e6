"""PPO for language models on MLX: the library (no Prefect in here)."""

from ppo_core.runtime import setup_blas as _setup_blas

# Runs before any submodule imports mlx, so MLX binds to OpenBLAS.
_setup_blas()
