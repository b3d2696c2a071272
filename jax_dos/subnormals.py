"""Subnormal floats flushed to zero in the host kernels' threads (x86's FTZ and DAZ), as XLA's CPU backend computes.

A float32 below 2**-126 in magnitude is subnormal. Adam makes them where gradients are tiny (``(1 - b2) g^2`` for
``|g| < 1e-19``: the head's rows of tokens a fine-tuning run never sees, while its loss spikes) and where a moment
decays with no gradient (``b1**k mu``). x86 cores handle a subnormal operand or result of a vector instruction by a
microcode assist unless the thread's MXCSR flushes them: measured on the development machine (AMD EPYC, 4 Mi
parameters, two busy threads, ``bench/results/host_kernel_subnormal-cpu/``), the bfloat16 kernel ran 0.47-0.48x its
rate with every gradient that small and 0.74-0.76x with 1.5 % of them; flushed, 0.99-1.04x.

XLA's CPU backend runs its programs with FTZ and DAZ set, so the jnp path flushes them (``x * 0.001`` of
``x = 1e-36`` is 0 under ``jit``); numba's kernels did not. With the flags set in every thread a kernel runs on, the
host kernels flush alike: the same bits as XLA's CPU backend on subnormal inputs too. XLA's GPU backend keeps
subnormals, so a subgroup updated there and one updated on the host differ only where a moment falls below 2**-126
(a weight's update is unchanged: ``sqrt(nu)`` of a subnormal ``nu`` is below 1.1e-19, far under ``eps``).

The flags are a thread's state. :func:`flushing` sets them in the calling thread for one launch and puts its own back;
the first launch from a calling thread (each has its own team of numba threads under OpenMP) sets them in every
thread of numba's pool, for good, by a parallel loop that records each thread's id until all have run it. numba's
threads then flush in any parallel kernel, a user's own included. On other architectures nothing is set (and the
kernels keep subnormals).
"""

from __future__ import annotations

import contextlib
import platform
import threading
from collections.abc import Iterator

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

FLUSH = np.uint32(0x8040)  # MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6)
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")
_ROUNDS = 20  # pool-wide settings tried at most, each a parallel loop of 8 iterations a thread


def _mxcsr_call(builder, name: str, slot) -> None:
  fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [slot.type]), name)
  builder.call(fn, [slot])


@intrinsic
def _read_mxcsr(typingctx):
  def codegen(context, builder, signature, args):
    slot = cgutils.alloca_once(builder, ir.IntType(32))
    _mxcsr_call(builder, "llvm.x86.sse.stmxcsr", slot)
    return builder.load(slot)

  return types.uint32(), codegen


@intrinsic
def _write_mxcsr(typingctx, value):
  def codegen(context, builder, signature, args):
    slot = cgutils.alloca_once(builder, ir.IntType(32))
    builder.store(args[0], slot)
    _mxcsr_call(builder, "llvm.x86.sse.ldmxcsr", slot)
    return context.get_dummy_value()

  return types.void(types.uint32), codegen


@numba.njit(nogil=True, cache=True)
def _flush_here():
  """FTZ and DAZ in the calling thread's MXCSR; returns its MXCSR before."""
  old = _read_mxcsr()
  _write_mxcsr(old | FLUSH)
  return old


@numba.njit(nogil=True, cache=True)
def _restore(mode):
  _write_mxcsr(mode)


@numba.njit(parallel=True, nogil=True, cache=True)
def _flush_in_pool(seen):
  for _k in numba.prange(seen.size * 8):
    _write_mxcsr(_read_mxcsr() | FLUSH)
    seen[numba.get_thread_id()] = 1


_pools: set[int] = set()  # the calling threads whose numba threads flush (OpenMP keeps a team for each)
_pools_lock = threading.Lock()


def _set_in_pool() -> None:
  """FTZ and DAZ in every thread of numba's pool that kernels launched from this thread run on."""
  caller = threading.get_ident()
  with _pools_lock:
    if caller in _pools:
      return
    threads = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # the whole pool (a setting of this thread's)
    try:
      seen = np.zeros(numba.config.NUMBA_NUM_THREADS, np.uint8)
      for _ in range(_ROUNDS):
        _flush_in_pool(seen)
        if seen.all():
          break
    finally:
      numba.set_num_threads(threads)
    _pools.add(caller)


@contextlib.contextmanager
def flushing() -> Iterator[None]:
  """Within: the calling thread and numba's threads flush subnormals (FTZ and DAZ); after, the calling thread's own
  mode again. Nothing on architectures other than x86-64."""
  if not SUPPORTED:
    yield
    return
  old = _flush_here()
  try:
    _set_in_pool()
    yield
  finally:
    _restore(old)
