"""Process set-up that must run before ``import mlx``.

MLX's Linux CPU wheel links the reference netlib BLAS (~2 GFLOP/s). Loading
OpenBLAS into the global symbol namespace first makes MLX resolve ``sgemm``
against it instead (100x faster). The thread count is read by OpenBLAS when
the library loads, so it must be fixed here, not later.

``keep_freed_memory`` stops glibc from handing large freed blocks back to the
kernel: MLX frees its multi-megabyte intermediates after every operation, and
by default glibc unmaps them (or trims the heap) and the next allocation of the
same size page-faults every 4 KB in again. Above ~1M float32 elements that
made an element-wise kernel 4-6x slower here (15 instead of 2.5 ns per element).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

THREADS_ENV = "PPO_BLAS_THREADS"
MALLOC_DEFAULTS_ENV = "PPO_MALLOC_DEFAULTS"  # "1": keep glibc's own malloc thresholds (to measure the difference)


@dataclass(frozen=True)
class BlasState:
    library: str | None
    threads: int
    error: str | None = None


_STATE: BlasState | None = None


def _openblas_path() -> Path | None:
    try:
        dist = importlib.metadata.distribution("cmeel-openblas")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name == "libopenblas.so.0":
            return Path(f.locate())
    return None


def default_threads() -> int:
    """Threads for OpenBLAS: the user's choice, else every core we may use.

    OpenBLAS threads spin; when another process owns a core they collapse
    throughput, so set PPO_BLAS_THREADS=1 when the machine is shared.
    """
    if THREADS_ENV in os.environ:
        return max(1, int(os.environ[THREADS_ENV]))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def setup_blas() -> BlasState:
    """Load OpenBLAS globally before MLX (Linux only; idempotent)."""
    global _STATE
    if _STATE is not None:
        return _STATE
    threads = default_threads()
    if platform.system() != "Linux":
        _STATE = BlasState(library=None, threads=threads, error="not Linux: MLX uses Accelerate/Metal")
        return _STATE
    if "mlx.core" in sys.modules:
        _STATE = BlasState(library=None, threads=threads, error="mlx was imported before ppo_core.runtime")
        return _STATE
    path = _openblas_path()
    if path is None:
        _STATE = BlasState(library=None, threads=threads, error="cmeel-openblas is not installed")
        return _STATE
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:  # typically libgfortran.so.5 missing: `make setup` installs it
        _STATE = BlasState(library=None, threads=threads, error=f"cannot load {path}: {exc}")
        return _STATE
    _STATE = BlasState(library=str(path), threads=threads)
    return _STATE


# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum: larger blocks are always mapped
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before any is returned


def keep_freed_memory() -> bool:
    """Fixed malloc thresholds so that freed blocks up to 32 MB are reused, not unmapped (glibc only).

    The process's memory stays at its high-water mark instead of shrinking
    between phases, which is what a training process does anyway. Returns
    whether the thresholds were set.
    """
    if os.environ.get(MALLOC_DEFAULTS_ENV) == "1" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def matmul_gflops(n: int = 1024, repeats: int = 5) -> tuple[float, float]:
    """Median float32 matmul GFLOP/s of MLX on the CPU, and max |error| vs numpy."""
    setup_blas()
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    a, b = mx.array(a_np), mx.array(b_np)
    mx.eval(a @ b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = a @ b
        mx.eval(c)
        times.append(time.perf_counter() - t0)
    times.sort()
    err = float(np.abs(np.array(c) - a_np.astype(np.float64) @ b_np.astype(np.float64)).max())
    return 2 * n**3 / times[len(times) // 2] / 1e9, err
