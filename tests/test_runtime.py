"""The fast BLAS is really what MLX multiplies with, and it computes the right numbers."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import numpy as np
import pytest

import ppo_core  # noqa: F401
import mlx.core as mx
from ppo_core.runtime import matmul_gflops, setup_blas

linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="OpenBLAS preloading is Linux-only (macOS uses Accelerate)")


@linux_only
def test_openblas_is_loaded_and_owns_the_global_sgemm():
    state = setup_blas()
    assert state.error is None, state.error
    assert state.library and Path(state.library).name == "libopenblas.so.0"
    maps = Path("/proc/self/maps").read_text()
    assert "libopenblas.so.0" in maps
    # symbol lookup in the global scope (what MLX's BLAS calls bind to) resolves to OpenBLAS
    global_sgemm = ctypes.cast(ctypes.CDLL(None).sgemm_, ctypes.c_void_p).value
    openblas_sgemm = ctypes.cast(ctypes.CDLL(state.library).sgemm_, ctypes.c_void_p).value
    assert global_sgemm == openblas_sgemm


def test_mlx_matmul_equals_numpy():
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 576, 49152 // 64), (33, 300, 17), (256, 1024, 256)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        got = np.array(mx.array(a) @ mx.array(b))
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.sqrt(k))


def test_matmul_gflops_reports_accuracy():
    gflops, err = matmul_gflops(n=256, repeats=3)
    assert gflops > 0
    assert err < 1e-2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@linux_only
def test_freed_blocks_below_32_mb_are_reused_not_unmapped():
    # importing ppo_core set the thresholds: an 8 MB block comes from the heap (no fresh mmap to page-fault in)
    # and freeing it keeps it for the next one (the heap is not trimmed back to the kernel)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype, libc.malloc.restype = _MallInfo2, ctypes.c_void_p
    mapped_before = libc.mallinfo2().hblks
    block = libc.malloc(8 * 1024 * 1024)
    assert block and libc.mallinfo2().hblks == mapped_before, "an 8 MB block was mmapped"
    libc.free(ctypes.c_void_p(block))
    assert libc.mallinfo2().fordblks >= 8 * 1024 * 1024, "the freed block was returned to the kernel"
