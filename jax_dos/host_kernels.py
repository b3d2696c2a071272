"""Fused, multi-threaded AdamW on host buffers (numba), updating in place.

One pass over ``g, p, m, v`` (``g`` times the step's gradient scale): reads
16 bytes (14 with bfloat16 gradients, widened exactly in the loop) and writes
12 (p, m, v) per parameter, the least any in-place Adam can move (torch's
fused CPU AdamW moves the same).
The engine sends the new master itself to the accelerator and forms the
update there, so no output buffer is written. The arithmetic is IEEE float32
in optax's order (see ``adam_math.py``): every constant is a float32
argument, so nothing is promoted to float64, and there is no ``fastmath``.

Each buffer is one ``prange`` over all cores, launched on numba's workqueue
layer (about 50 us a launch; OpenMP's took milliseconds whenever a core was
busy, see below). ``nogil=True`` lets the engine's Python thread keep
dispatching accelerator work meanwhile.

Ownership (why in-place writes are safe): the engine only passes buffers it
owns: master, mu and nu belong to the optimizer state, which ``update``
consumes like a donated argument, and the engine waits for every transfer that
reads them (the previous step's master to the accelerator, say) before it
writes them again. Gradients are only read.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import numba
import numpy as np

# numba's OpenMP layer waits at its barriers for every thread of the team: with any core busy (XLA's
# threads, the engine's dispatch thread) a launch took 4-8 ms here, against ~50 us for the workqueue
# layer, which the engine's single calling thread can use safely. A user's explicit choice wins.
if "NUMBA_THREADING_LAYER" not in os.environ:
  numba.config.THREADING_LAYER = "workqueue"


@numba.njit(inline="always")
def _load_f32(x):
  return x


@numba.njit(inline="always")
def _load_bf16(x):  # x: the uint16 bits of a bfloat16; widening is exact
  return np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)


def _make_adam_kernel(load_grad):
  @numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
  def adam_inplace(g, p, m, v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, gs, decay):
    # Keep this a prange over whole arrays: numba's parfor lowering is what lets LLVM vectorize the loop
    # (a plain range loop, or a loop over pointer-made arrays, stayed scalar and ran 6x slower).
    for i in numba.prange(g.shape[0]):
      gi = load_grad(g[i]) * gs
      mi = one_minus_b1 * gi + b1 * m[i]
      vi = one_minus_b2 * (gi * gi) + b2 * v[i]
      u = (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps)
      pi = p[i]
      if decay:
        u = u + wd * pi
      u = neg_lr * u
      m[i] = mi
      v[i] = vi
      p[i] = pi + u

  return adam_inplace


# Gradients arrive as float32 or as bfloat16 (read as uint16 bits: half the PCIe and DRAM bytes of float32).
_KERNELS = {"float32": _make_adam_kernel(_load_f32), "bfloat16": _make_adam_kernel(_load_bf16)}
GRAD_DTYPES = tuple(_KERNELS)


def adam_many(
  buffers: Sequence[tuple],
  decay: Sequence[bool],
  *,
  b1: float,
  b2: float,
  eps: float,
  eps_root: float,
  weight_decay: float,
  scalars: np.ndarray,
) -> None:
  """AdamW step on many ``(g, p, m, v)`` buffers: ``p, m, v`` (float32) in place, all checked before any write.

  ``g`` is float32 or bfloat16. Each buffer is a numpy array or a
  single-device host-memory jax array (a shard); the four of a tuple must have one size. ``decay[j]`` says whether
  tuple ``j`` gets weight decay. ``scalars`` is ``[-lr, 1 - b1**t, 1 - b2**t]``
  or ``[-lr, 1 - b1**t, 1 - b2**t, grad_scale]`` as float32 (``adam_math.step_scalars``).
  """
  if len(buffers) != len(decay):
    raise ValueError(f"{len(buffers)} buffer tuples but {len(decay)} decay flags.")
  views = []
  for quad in buffers:
    if len(quad) != 4 or not quad[0].size == quad[1].size == quad[2].size == quad[3].size:
      raise ValueError(f"host kernel needs four buffers of one size, got shapes {[np.shape(b) for b in quad]}.")
    if not all(b.dtype == np.float32 for b in quad[1:]) or str(quad[0].dtype) not in GRAD_DTYPES:
      raise TypeError(
        f"host kernel needs float32 state and {' or '.join(GRAD_DTYPES)} gradients, got {[str(b.dtype) for b in quad]}."
      )
    g, state = quad[0], quad[1:]
    bits = np.float32 if str(g.dtype) == "float32" else np.uint16
    g = g.reshape(-1).view(bits) if isinstance(g, np.ndarray) else writable_view(g, bits)
    views.append([g, *(b.reshape(-1) if isinstance(b, np.ndarray) else writable_view(b) for b in state)])
  f = np.float32
  # (1 - b) is rounded from a Python double, exactly as JAX does for optax.
  hyper = (f(b1), f(1 - b1), f(b2), f(1 - b2), f(eps), f(eps_root), f(weight_decay))
  step = (f(scalars[0]), f(scalars[1]), f(scalars[2]), f(scalars[3]) if len(scalars) > 3 else f(1))
  for (g, p, m, v), d in zip(views, decay):
    if g.size:
      _KERNELS["float32" if g.dtype == np.float32 else "bfloat16"](g, p, m, v, *hyper, *step, bool(d))


def adam_inplace(g: np.ndarray, p: np.ndarray, m: np.ndarray, v: np.ndarray, *, decay: bool, **hyper) -> None:
  """AdamW step on one set of flat float32 buffers (see :func:`adam_many`)."""
  adam_many([(g, p, m, v)], [decay], **hyper)


@numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _copy(dst, src):
  for i in numba.prange(src.shape[0]):
    dst[i] = src[i]


def snapshot(x) -> np.ndarray:
  """A copy of a host-resident jax array in ordinary memory, made by all cores.

  XLA's host-to-host ``device_put`` copies on one thread (1.7 GB/s measured on
  the H100 machine); this copies at DRAM speed. Multi-device arrays are
  assembled by ``np.asarray``, which already copies.
  """
  if len(x.addressable_shards) != 1:
    return np.asarray(x)
  src = np.asarray(x)
  out = np.empty(src.shape, src.dtype)
  if src.size:
    _copy(out.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))
  return out


def writable_view(array_shard, dtype=np.float32) -> np.ndarray:
  """A writable, flat numpy view of one single-device host-memory jax array.

  ``np.asarray`` of a ``pinned_host`` array is a read-only zero-copy view; the
  buffer pointer gives a writable one. Only for buffers the caller owns.
  """
  n = int(np.prod(array_shard.shape, dtype=np.int64))
  if n == 0:
    return np.empty((0,), dtype)
  raw = (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(array_shard.unsafe_buffer_pointer())
  return np.frombuffer(raw, dtype=dtype)


def set_num_threads(n: int | None = None) -> int:
  """Sets the host kernel's thread count (default: all cores). Returns it."""
  n = n or int(os.environ.get("JAX_DOS_HOST_THREADS", numba.config.NUMBA_NUM_THREADS))
  numba.set_num_threads(n)
  return n
