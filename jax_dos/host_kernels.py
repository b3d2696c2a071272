"""Fused, multi-threaded AdamW on host buffers (numba), updating in place.

One pass over ``g, p, m, v`` per leaf: reads 16 bytes and writes 12 (p, m, v),
the least any in-place Adam can move (torch's fused CPU AdamW moves the same).
The engine sends the new master itself to the accelerator and forms the
update there, so no output buffer is written. The loop is ``prange``-parallel
over all cores, compiled with ``nogil=True`` so the engine's Python thread keeps
dispatching accelerator work while it runs, and written float32-clean: every
constant is a float32 argument, so nothing is promoted to float64. No
``fastmath``: the arithmetic is IEEE and in optax's order (see
``adam_math.py``), so host results match the accelerator's to rounding.

Ownership (why in-place writes are safe): the engine only passes buffers it
owns: master, mu and nu belong to the optimizer state, which ``update``
consumes like a donated argument, and the engine waits for every transfer that
reads them (the previous step's master to the accelerator, say) before it
writes them again. Gradients are only read.
"""

from __future__ import annotations

import ctypes
import os

import numba
import numpy as np


@numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _adam_inplace(g, p, m, v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, decay):
  for i in numba.prange(g.shape[0]):
    gi = g[i]
    mi = one_minus_b1 * gi + b1 * m[i]
    vi = one_minus_b2 * (gi * gi) + b2 * v[i]
    u = (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps)
    pi = p[i]
    if decay:
      u = u + wd * pi
    u = neg_lr * u
    pi = pi + u
    m[i] = mi
    v[i] = vi
    p[i] = pi


def adam_inplace(
  g: np.ndarray,
  p: np.ndarray,
  m: np.ndarray,
  v: np.ndarray,
  *,
  b1: float,
  b2: float,
  eps: float,
  eps_root: float,
  weight_decay: float,
  decay: bool,
  scalars: np.ndarray,
) -> None:
  """AdamW step on flat float32 buffers: updates ``p, m, v`` in place from ``g``.

  ``scalars`` is ``[-lr, 1 - b1**t, 1 - b2**t]`` as float32 (``adam_math.step_scalars``).
  """
  if not (g.shape == p.shape == m.shape == v.shape) or g.ndim != 1:
    raise ValueError(
      f"host kernel needs four flat buffers of one size, got {g.shape}, {p.shape}, {m.shape}, {v.shape}."
    )
  if any(a.dtype != np.float32 for a in (g, p, m, v)):
    raise TypeError("host kernel buffers must be float32.")
  if g.size == 0:
    return
  f = np.float32
  # (1 - b) is rounded from a Python double, exactly as JAX does for optax.
  _adam_inplace(
    g,
    p,
    m,
    v,
    f(b1),
    f(1 - b1),
    f(b2),
    f(1 - b2),
    f(eps),
    f(eps_root),
    f(weight_decay),
    f(scalars[0]),
    f(scalars[1]),
    f(scalars[2]),
    bool(decay),
  )


def writable_view(array_shard, dtype=np.float32) -> np.ndarray:
  """A writable, flat numpy view of one single-device host-memory jax array.

  ``np.asarray`` of a ``pinned_host`` array is a read-only zero-copy view; the
  buffer pointer gives a writable one. Only for buffers the caller owns.
  """
  n = int(np.prod(array_shard.shape, dtype=np.int64))
  if n == 0:
    return np.empty((0,), dtype)
  nbytes = n * np.dtype(dtype).itemsize
  raw = (ctypes.c_char * nbytes).from_address(array_shard.unsafe_buffer_pointer())
  return np.frombuffer(raw, dtype=dtype)


def set_num_threads(n: int | None = None) -> int:
  """Sets the host kernel's thread count (default: all cores). Returns it."""
  n = n or int(os.environ.get("JAX_DOS_HOST_THREADS", numba.config.NUMBA_NUM_THREADS))
  numba.set_num_threads(n)
  return n
