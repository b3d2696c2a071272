"""Fused, multi-threaded AdamW on host buffers (numba), updating in place.

One pass over ``g, p, m, v`` (``g`` times the step's gradient scale): reads
16 bytes (14 with bfloat16 gradients, widened exactly in the loop) and writes
12 (p, m, v) per parameter, the least any in-place Adam can move (torch's
fused CPU AdamW moves the same).
The engine sends the new master itself to the accelerator and forms the
update there, so no update buffer is written. For bfloat16 parameters the
kernel also writes the new master rounded to bfloat16 (``low``, round to
nearest even, as XLA's convert) in the same pass: 2 more bytes written here
save 2 of the 4 that would cross PCIe. The arithmetic is IEEE float32
in optax's order, written once for every kernel (``adam_math.nb_moments``
and ``nb_weight``): every constant is a float32 argument, so nothing is
promoted to float64, and there is no ``fastmath``.

Each buffer is one ``prange`` over all cores, one launch at a time in the
process (``parallel_launch``). ``nogil=True`` lets the engine's Python thread keep
dispatching accelerator work meanwhile.

Ownership (why in-place writes are safe): the engine only passes buffers it
owns: master, mu and nu belong to the optimizer state, which ``update``
consumes like a donated argument, the bfloat16 copies to the engine, and the
engine waits for every transfer that reads them (the previous step's master to
the accelerator, say) before it writes them again. Gradients are only read.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Sequence

import numba
import numpy as np

from jax_dos.core import adam_math
from jax_dos.core import moment_formats as mf
from jax_dos.kernels import host_compact
from jax_dos.parallel_launch import one_launch_at_a_time


def _sources_digest() -> str:
  """A digest of the sources the kernels inline (this module, ``adam_math``, ``moment_formats``, ``host_compact``)."""
  digest = hashlib.sha256()
  for path in sorted({__file__, adam_math.__file__, mf.__file__, host_compact.__file__}):
    with open(path, "rb") as f:
      digest.update(f.read())
  return digest.hexdigest()[:16]


_SOURCES = _sources_digest()


def _same_in_every_process(helper):
  """``helper`` (a jitted function that kernels below close over) pickled alike in every process.

  numba finds a cached closure by its code and the pickled bytes of its cells. A jitted function pickles with an id
  drawn at random per process, which would make every process compile the kernels again (1-2 s each); the id is
  the function's name and a digest of the sources the kernels inline instead, so that an edit to ``adam_math`` or
  ``moment_formats`` (files numba's cache does not watch) compiles them again (a numba without ``_set_uuid``
  compiles them in every process).
  """
  if hasattr(helper, "_set_uuid"):
    helper._set_uuid(f"{helper.py_func.__module__}.{helper.py_func.__qualname__}.{_SOURCES}")
  return helper


@_same_in_every_process
@numba.njit(inline="always")
def _load_f32(x):
  return x


@_same_in_every_process
@numba.njit(inline="always")
def _load_bf16(x):  # x: the uint16 bits of a bfloat16; widening is exact
  return np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)


@_same_in_every_process
@numba.njit(inline="always")
def _bf16_bits(x):  # float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN
  bits = np.float32(x).view(np.uint32)
  if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
    return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
  rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
  return np.uint16((bits + rounding) >> np.uint32(16))


@_same_in_every_process
@numba.njit(inline="always")
def _store_f32(x):
  return x


@numba.njit(inline="always")
def _adam_element(i, g, p, m, v, low, low_m, low_v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1,
                  bc2, gs, decay, write_low, predict, next_neg_lr, next_bc1, next_bc2, write_state, write_moments,
                  load_grad, store_low):  # fmt: skip
  mi, vi = adam_math.nb_moments(load_grad(g[i]) * gs, m[i], v[i], b1, one_minus_b1, b2, one_minus_b2)
  pn = adam_math.nb_weight(p[i], mi, vi, eps, eps_root, wd, neg_lr, bc1, bc2, decay)
  if write_state:
    m[i] = mi
    v[i] = vi
    p[i] = pn
  if predict:  # adam_math.predict_next, in its order
    low[i] = store_low(adam_math.nb_weight(pn, mi, vi, eps, eps_root, wd, next_neg_lr, next_bc1, next_bc2, decay))
  elif write_low:
    low[i] = store_low(pn)
  if write_moments:
    low_m[i] = store_low(mi)
    low_v[i] = store_low(vi)


def _make_adam_kernel(load_grad, store_low):
  @numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
  def adam_inplace(
    g, p, m, v, low, low_m, low_v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, gs, decay,
    write_low, predict, next_neg_lr, next_bc1, next_bc2, write_state, write_moments,
  ):  # fmt: skip
    # Keep each a prange over whole arrays: numba's parfor lowering is what lets LLVM vectorize the loop
    # (a plain range loop, or a loop over pointer-made arrays, stayed scalar and ran 6x slower). The engine's two
    # calls (the state and, or not, the new weights' low copy) each have a loop with their flags constant: a flag
    # tested in the loop kept LLVM from vectorizing a conditional 16-bit store (host_compact.make_bf16_kernel).
    if write_state and not predict and not write_moments and write_low:
      for i in numba.prange(g.shape[0]):
        _adam_element(i, g, p, m, v, low, low_m, low_v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                      neg_lr, bc1, bc2, gs, decay, True, False, next_neg_lr, next_bc1, next_bc2, True, False,
                      load_grad, store_low)  # fmt: skip
    elif write_state and not predict and not write_moments:
      for i in numba.prange(g.shape[0]):
        _adam_element(i, g, p, m, v, low, low_m, low_v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                      neg_lr, bc1, bc2, gs, decay, False, False, next_neg_lr, next_bc1, next_bc2, True, False,
                      load_grad, store_low)  # fmt: skip
    else:
      for i in numba.prange(g.shape[0]):
        _adam_element(i, g, p, m, v, low, low_m, low_v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                      neg_lr, bc1, bc2, gs, decay, write_low, predict, next_neg_lr, next_bc1, next_bc2, write_state,
                      write_moments, load_grad, store_low)  # fmt: skip

  return adam_inplace


def _make_adam_into_kernel(load_grad, store_low):
  @numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
  def adam_into(g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr,
                bc1, bc2, gs, decay):  # fmt: skip
    # adam_inplace's arithmetic, in its order, writing the new state into other buffers.
    for i in numba.prange(g.shape[0]):
      mi, vi = adam_math.nb_moments(load_grad(g[i]) * gs, m[i], v[i], b1, one_minus_b1, b2, one_minus_b2)
      pn = adam_math.nb_weight(p[i], mi, vi, eps, eps_root, wd, neg_lr, bc1, bc2, decay)
      m_out[i] = mi
      v_out[i] = vi
      p_out[i] = pn
      low[i] = store_low(pn)

  return adam_into


def _make_predict_kernel(store_low):
  @numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
  def predict(low, p, m, v, eps, eps_root, wd, neg_lr, bc1, bc2, decay):
    for i in numba.prange(p.shape[0]):
      low[i] = store_low(adam_math.nb_weight(p[i], m[i], v[i], eps, eps_root, wd, neg_lr, bc1, bc2, decay))

  return predict


# Gradients arrive as float32 or as bfloat16 (read as uint16 bits: half the PCIe and DRAM bytes of float32); the
# copy of the new weights the engine sends (``low``) is bfloat16 (uint16 bits) or, for predictions, float32.
_LOADS = {"float32": _load_f32, "bfloat16": _load_bf16}
_STORES = {"float32": _store_f32, "bfloat16": _bf16_bits}
_KERNELS = {(g, lo): _make_adam_kernel(_LOADS[g], _STORES[lo]) for g in _LOADS for lo in _STORES}
_PREDICT_KERNELS = {lo: _make_predict_kernel(_STORES[lo]) for lo in _STORES}
_INTO_KERNELS = {(g, lo): _make_adam_into_kernel(_LOADS[g], _STORES[lo]) for g in _LOADS for lo in _STORES}
GRAD_DTYPES = tuple(_LOADS)
LOW_DTYPES = tuple(_STORES)
_VIEW = {"float32": np.float32, "bfloat16": np.uint16, "uint8": np.uint8}
_COMPACT = {
  (fmt, g, lo): make(_LOADS[g], _STORES[lo])
  for fmt, make in (("bfloat16", host_compact.make_bf16_kernel), ("int8", host_compact.make_int8_kernel))
  for g in _LOADS
  for lo in _STORES
}


def _compact(buffers, decay, hyper: tuple, scalars, write_state: bool, into: bool) -> None:
  """:func:`adam_many` (``into=False``) or :func:`adam_many_into` for bfloat16 or int8 moments (``host_compact``)."""
  if len(scalars) != 5:
    raise ValueError("compact moments need the step's five scalars (adam_math.step_scalars with hyper.moments set).")
  views = []
  for bufs in buffers:
    n_state = 7 if into else 4
    if len(bufs) not in ((8,) if into else (4, 5)):
      raise ValueError(
        "with compact moments the host kernel takes (g, p, m, v[, low]) or (g, p, m, v, p_out, m_out, v_out, low);"
        f" got {len(bufs)} buffers (no predictions or moment copies: those need float32 moments)."
      )
    dtypes = [str(b.dtype) for b in bufs]
    state_ok = dtypes[1] == "float32" and dtypes[2] in ("bfloat16", "uint8") and dtypes[3] == dtypes[2]
    if into:
      state_ok = state_ok and dtypes[4] == "float32" and dtypes[5] == dtypes[6] == dtypes[2]
    if not state_ok or dtypes[0] not in GRAD_DTYPES or (len(bufs) > n_state and dtypes[-1] not in LOW_DTYPES):
      raise TypeError(
        f"host kernel needs float32 masters, moments of one compact format (bfloat16, or uint8 for int8) and"
        f" {' or '.join(GRAD_DTYPES)} gradients, got {dtypes}."
      )
    fmt = "bfloat16" if dtypes[2] == "bfloat16" else "int8"
    n = bufs[0].size
    moment_size = np.prod(mf.stored_shape((n,), fmt))
    if any(b.size != n for b in (bufs[1], *bufs[n_state:])) or any(b.size != moment_size for b in bufs[2:4]):
      raise ValueError(f"host kernel: buffers of {n} parameters need {fmt} moments of {moment_size} elements each.")
    flat = _flat_all(bufs, dtypes)
    g, p, m, v = flat[:4]
    po, mo, vo = flat[4:7] if into else (p, m, v)
    low = flat[n_state] if len(flat) > n_state else _NO_LOW
    views.append((g, p, m, v, po, mo, vo, low))
  f = np.float32
  step = (f(scalars[0]), f(scalars[1]), f(scalars[2]), f(scalars[3]))
  keys = (mf.host_key(float(scalars[4]), 0), mf.host_key(float(scalars[4]), 1))
  for (g, p, m, v, po, mo, vo, low), d in zip(views, decay):
    if not g.size:
      continue
    fmt = "bfloat16" if m.dtype == np.uint16 else "int8"
    kernel = _COMPACT[fmt, _dtype_name(g), _dtype_name(low)]
    if fmt == "int8":
      (mc, mw), (vc, vw) = host_compact.int8_views(m), host_compact.int8_views(v)
      (mc_o, mw_o), (vc_o, vw_o) = host_compact.int8_views(mo), host_compact.int8_views(vo)
      kernel(g, p, mc, mw, vc, vw, po, mc_o, mw_o, vc_o, vw_o, low, *hyper, *step, *keys, bool(d),
             low is not _NO_LOW, bool(write_state))  # fmt: skip
    else:
      kernel(g, p, m, v, po, mo, vo, low, *hyper, *step, *keys, bool(d), low is not _NO_LOW, bool(write_state))


@one_launch_at_a_time
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
  next_scalars: np.ndarray | None = None,
  write_state: bool = True,
) -> None:
  """AdamW step on many ``(g, p, m, v[, low[, low_m, low_v]])`` buffers, in place, all checked before any write.

  ``p, m, v`` are float32 and updated; ``g`` is float32 or bfloat16 and only
  read; ``low`` (bfloat16 or float32), where given, receives the new ``p``
  in its dtype, or with ``next_scalars`` (the next step's) the prediction
  ``adam_math.predict_next(p, m, v, next_scalars)`` of the new state;
  ``low_m`` and ``low_v``, where given, the new ``m`` and ``v`` in ``low``'s
  dtype (the copies ``delay_predict="gradient"`` sends ahead). Each
  buffer is a numpy array or a single-device host-memory jax array (a shard);
  the buffers of a tuple must have one size. ``decay[j]`` says whether tuple
  ``j`` gets weight decay. ``write_state=False`` writes ``low`` only (the new
  weights, state untouched: a second call with the same inputs then writes
  the state, with identical arithmetic). ``scalars`` is ``[-lr, 1 - b1**t, 1 - b2**t]`` or
  ``[-lr, 1 - b1**t, 1 - b2**t, grad_scale]`` as float32 (``adam_math.step_scalars``).
  """
  if len(buffers) != len(decay):
    raise ValueError(f"{len(buffers)} buffer tuples but {len(decay)} decay flags.")
  if _has_compact(buffers):
    if next_scalars is not None:
      raise ValueError("predictions (next_scalars) need float32 moments.")
    hyper = _hyper(b1, b2, eps, eps_root, weight_decay)
    return _compact(buffers, decay, hyper, scalars, write_state, into=False)
  views = []
  for bufs in buffers:
    if len(bufs) not in (4, 5, 7) or len({b.size for b in bufs}) != 1:
      raise ValueError(
        f"host kernel needs four, five or seven buffers of one size, got shapes {[np.shape(b) for b in bufs]}."
      )
    dtypes = [str(b.dtype) for b in bufs]
    copies_ok = len(set(dtypes[4:])) <= 1 and set(dtypes[4:]) <= set(LOW_DTYPES)
    if dtypes[1:4] != ["float32"] * 3 or dtypes[0] not in GRAD_DTYPES or not copies_ok:
      raise TypeError(
        f"host kernel needs float32 state, {' or '.join(GRAD_DTYPES)} gradients and a bfloat16 or float32 copy"
        f" (if any; moment copies in the same dtype), got {dtypes}."
      )
    if (next_scalars is not None or not write_state) and len(bufs) == 4:
      raise ValueError("a prediction (next_scalars) or write_state=False needs a fifth buffer to write to.")
    flat = _flat_all(bufs, dtypes)
    views.append(flat + [_NO_LOW] * (7 - len(flat)))
  f = np.float32
  # (1 - b) is rounded from a Python double, exactly as JAX does for optax.
  hyper = (f(b1), f(1 - b1), f(b2), f(1 - b2), f(eps), f(eps_root), f(weight_decay))
  step = (f(scalars[0]), f(scalars[1]), f(scalars[2]), f(scalars[3]) if len(scalars) > 3 else f(1))
  predict = next_scalars is not None
  nxt = (f(next_scalars[0]), f(next_scalars[1]), f(next_scalars[2])) if predict else (f(0), f(1), f(1))
  for (g, p, m, v, low, low_m, low_v), d in zip(views, decay):
    if g.size:
      kernel = _KERNELS[_dtype_name(g), _dtype_name(low)]
      moments = low_m is not _NO_LOW
      if not moments:  # numba types each argument: the unused moment slots take low's dtype
        low_m = low_v = low[:0]
      kernel(g, p, m, v, low, low_m, low_v, *hyper, *step, bool(d), low is not _NO_LOW, predict, *nxt,
             bool(write_state), moments)  # fmt: skip


@one_launch_at_a_time
def adam_many_into(
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
  """AdamW step on many ``(g, p, m, v, p_out, m_out, v_out, low)`` buffers: the new state into the ``_out`` ones.

  :func:`adam_many`'s arithmetic, bit for bit, reading ``p, m, v`` and
  writing the new ``p, m, v`` (float32) into ``p_out, m_out, v_out`` and the
  new ``p`` in ``low``'s dtype (bfloat16 or float32) into ``low``. The old
  state stays intact, so a step can be taken again from it. It moves more
  DRAM than in place: a store to a line the cache does not hold reads the
  line first, so the three new state buffers are read as well as written
  (about 42 bytes a parameter against in place's 30; 0.69-0.76x in place's
  rate on an H100 machine's 16 cores, ``bench/results/host_kernel_into-h100``).
  """
  if len(buffers) != len(decay):
    raise ValueError(f"{len(buffers)} buffer tuples but {len(decay)} decay flags.")
  if _has_compact(buffers):
    return _compact(buffers, decay, _hyper(b1, b2, eps, eps_root, weight_decay), scalars, True, into=True)
  views = []
  for bufs in buffers:
    if len(bufs) != 8 or len({b.size for b in bufs}) != 1:
      raise ValueError(f"adam_many_into needs eight buffers of one size, got shapes {[np.shape(b) for b in bufs]}.")
    dtypes = [str(b.dtype) for b in bufs]
    if dtypes[1:7] != ["float32"] * 6 or dtypes[0] not in GRAD_DTYPES or dtypes[7] not in LOW_DTYPES:
      raise TypeError(
        f"adam_many_into needs float32 state (in and out), {' or '.join(GRAD_DTYPES)} gradients and a bfloat16 or"
        f" float32 copy, got {dtypes}."
      )
    views.append(_flat_all(bufs, dtypes))
  f = np.float32
  hyper = (f(b1), f(1 - b1), f(b2), f(1 - b2), f(eps), f(eps_root), f(weight_decay))
  step = (f(scalars[0]), f(scalars[1]), f(scalars[2]), f(scalars[3]) if len(scalars) > 3 else f(1))
  for (g, *state, low), d in zip(views, decay):
    if g.size:
      _INTO_KERNELS[_dtype_name(g), _dtype_name(low)](g, *state, low, *hyper, *step, bool(d))


@one_launch_at_a_time
def predict_many(
  buffers: Sequence[tuple], decay: Sequence[bool], *, eps: float, eps_root: float, weight_decay: float, scalars
) -> None:
  """Writes ``adam_math.predict_next(p, m, v, scalars)`` into ``low`` for each ``(low, p, m, v)`` tuple.

  ``low`` is bfloat16 or float32; ``p, m, v`` float32 and only read. Used where
  no kernel pass has written the prediction (the first delayed step).
  """
  f = np.float32
  for (low, p, m, v), d in zip(buffers, decay):
    if str(low.dtype) not in LOW_DTYPES or {str(x.dtype) for x in (p, m, v)} != {"float32"}:
      raise TypeError(f"prediction needs float32 state and a bfloat16 or float32 output, got {low.dtype}.")
    if p.size:
      lo = _flat(low, _VIEW[str(low.dtype)])
      _PREDICT_KERNELS[str(low.dtype)](
        lo, *(_flat(x, np.float32) for x in (p, m, v)), f(eps), f(eps_root), f(weight_decay),
        f(scalars[0]), f(scalars[1]), f(scalars[2]), bool(d),
      )  # fmt: skip


def _has_compact(buffers) -> bool:
  return any(len(b) > 2 and str(b[2].dtype) != "float32" for b in buffers)


def _hyper(b1, b2, eps, eps_root, weight_decay) -> tuple:
  f = np.float32
  # (1 - b) is rounded from a Python double, exactly as JAX does for optax.
  return (f(b1), f(1 - b1), f(b2), f(1 - b2), f(eps), f(eps_root), f(weight_decay))


def _dtype_name(view: np.ndarray) -> str:
  return "float32" if view.dtype == np.float32 else "bfloat16"


_NO_LOW = np.empty((0,), np.uint16)


def _flat(buffer, dtype) -> np.ndarray:
  """A flat, writable view of ``buffer`` (a numpy array or a host-memory shard) as ``dtype``."""
  return buffer.reshape(-1).view(dtype) if isinstance(buffer, np.ndarray) else writable_view(buffer, dtype)


def _flat_all(bufs, dtypes) -> list[np.ndarray]:
  """``bufs`` as flat views (``_flat``), the gradient (only read) made read-only: numba compiles a kernel once for
  each set of argument types, a read-only array's among them, so a gradient given read-only (``np.asarray`` of a jax
  array) or writable gets the one compiled kernel (the same machine code either way) instead of two compilations."""
  flat = [_flat(b, _VIEW[t]) for b, t in zip(bufs, dtypes)]
  flat[0] = flat[0].view()
  flat[0].flags.writeable = False
  return flat


def adam_inplace(g: np.ndarray, p: np.ndarray, m: np.ndarray, v: np.ndarray, *, decay: bool, **hyper) -> None:
  """AdamW step on one set of flat float32 buffers (see :func:`adam_many`)."""
  adam_many([(g, p, m, v)], [decay], **hyper)


@numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _to_bf16(dst, src):
  for i in numba.prange(src.shape[0]):
    dst[i] = _bf16_bits(src[i])


@one_launch_at_a_time
def round_to_bf16(dst, src) -> None:
  """Writes ``src`` (float32) rounded to bfloat16 into ``dst`` (bfloat16), by all cores; both host buffers of one size.

  Rounds as :func:`adam_many`'s ``low`` output does (and as XLA's convert).
  """
  if dst.size != src.size or str(dst.dtype) != "bfloat16" or str(src.dtype) != "float32":
    raise TypeError(f"round_to_bf16 needs float32 -> bfloat16 of one size, got {src.dtype} -> {dst.dtype}.")
  if src.size:
    _to_bf16(_flat(dst, np.uint16), _flat(src, np.float32))


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


# Cores the overlapped step's host kernel leaves to the training thread and XLA's runtime on a machine of at least 8: a
# stage program's launches are the training thread's work, and the accelerator idles while they wait for a core.
TRAINING_CORES = 2


@one_launch_at_a_time
def set_num_threads(n: int | None = None, leave: int = 0) -> int:
  """Sets the host kernel's thread count for kernels launched from the calling thread. Returns it.

  ``n`` threads; else ``JAX_DOS_HOST_THREADS``; else all cores, less
  ``leave`` where there are at least four times as many. numba's setting is
  per launching thread.
  """
  cores = numba.config.NUMBA_NUM_THREADS
  n = n or int(os.environ.get("JAX_DOS_HOST_THREADS", 0)) or (cores - leave if cores >= 4 * leave else cores)
  numba.set_num_threads(min(n, cores))
  return min(n, cores)
