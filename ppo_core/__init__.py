"""PPO for language models on MLX: the library (no Prefect in here)."""

import os as _os

from ppo_core.runtime import keep_freed_memory as _keep_freed_memory, setup_blas as _setup_blas

# Runs before any submodule imports mlx, so MLX binds to OpenBLAS.
_setup_blas()
if _os.environ.get("PPO_MALLOC_DEFAULTS") != "1":  # for measuring the difference
    _keep_freed_memory()
