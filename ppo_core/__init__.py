"""PPO for language models on MLX: the library (no Prefect in here)."""

from ppo_core.runtime import keep_freed_memory as _keep_freed_memory, setup_blas as _setup_blas

# Runs before any submodule imports mlx, so MLX binds to OpenBLAS.
_setup_blas()
_keep_freed_memory()
