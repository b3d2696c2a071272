"""The bound probe's variants: the host kernels' steps by other code, with the same bits (``host_kernel_bound.py``
checks them byte for byte against the kernels and times them beside them).

- ``bf16_spans``: ``host_compact``'s bfloat16 step a span of ``SPAN`` elements at a time, the hash inputs an
  induction, optionally prefetching ``ahead`` spans on;
- ``int8``: its int8 step with the weights in the first pass or the second, optionally prefetching ``ahead`` blocks
  on;
- the ``_reciprocal`` weight: the two divides by the step's constants ``1 - b**t`` as a multiply and two fused
  multiply-adds (:func:`div_by`).

Import it after the probe has set numba's cache folder (its kernels compile there).
"""

from __future__ import annotations

import numba
import numba.extending
import numpy as np
from llvmlite import ir
from numba.core import cgutils

from jax_dos.core import adam_math
from jax_dos.core import moment_formats as mf
from jax_dos.kernels import host_compact

F = np.float32
_OPTS = dict(parallel=True, nogil=True, boundscheck=False)


@numba.extending.intrinsic
def _prefetch(typingctx, arr, idx):
  """``llvm.prefetch`` of ``arr[idx]``'s line towards L2 (a read, locality 2): one instruction, never a fault."""
  if not isinstance(arr, numba.types.Array) or not isinstance(idx, numba.types.Integer):
    return None

  def codegen(context, builder, sig, args):
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    i8p = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p.type, i32, i32, i32]),
                                        "llvm.prefetch.p0")  # fmt: skip
    builder.call(fn, [i8p, i32(0), i32(2), i32(1)])
    return context.get_dummy_value()

  return numba.types.void(arr, idx), codegen


@numba.njit(inline="always")
def _prefetch_lines(g, p, m, v, start, count, moment_step):
  """Prefetches the lines of elements ``start .. start + count`` of ``g, p`` (float32: 16 a line) and of the moments
  ``m, v`` (``moment_step`` elements a line)."""
  for q in range(0, count, 16):
    _prefetch(g, np.uint64(start + q))
    _prefetch(p, np.uint64(start + q))
  for q in range(0, count, moment_step):
    _prefetch(m, np.uint64(start + q))
    _prefetch(v, np.uint64(start + q))


SPAN = 256  # the bfloat16 variants' elements a span
_CI = np.uint32(mf._C_IDX)
_VOPTS = dict(parallel=True, nogil=True, boundscheck=False, error_model="numpy")


TINY, UP, DOWN = F(2.0**-60), F(2.0**64), F(2.0**-64)


@numba.njit(inline="always")
def div_by(a, b, y):
  """``RN(a / b)`` for a step constant ``0 < b <= 1`` given ``y = RN(1 / b)``, without a divide: Markstein's theorem
  (``q`` within an ulp of ``a / b`` and ``y`` within half an ulp of ``1 / b`` make ``r = a - b q`` exact and
  ``RN(q + r y)`` the correctly rounded quotient) where ``r`` does not underflow, so ``|a| < 2**-60`` is scaled by
  ``2**64`` first (exact both ways: ``|a / b| >= |a|``)."""
  small = abs(a) < TINY
  x = a * UP if small else a
  q = x * y
  q = mf.nb_fma(mf.nb_fma(-q, b, x), y, q)
  return q * DOWN if small else q


@numba.njit(inline="always")
def weight_reciprocal(p, m, v, eps, eps_root, wd, neg_lr, bc1, bc2, decay):
  """``adam_math.nb_weight``'s bits with its two divides by the step's constants as ``_div_by`` (the reciprocals
  loop-invariant, hoisted out of the loop)."""
  u = div_by(m, bc1, F(1) / bc1) / (np.sqrt(div_by(v, bc2, F(1) / bc2) + eps_root) + eps)
  if decay:
    u = u + wd * p
  return p + neg_lr * u


@numba.njit(**_OPTS)
def f32_reciprocal(g, p, m, v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, gs):
  """host_kernels' float32 step (state in place, no decay, no copy), the weight by ``weight_reciprocal``."""
  for i in numba.prange(g.shape[0]):
    mi, vi = adam_math.nb_moments(g[i] * gs, m[i], v[i], b1, one_minus_b1, b2, one_minus_b2)
    p[i] = weight_reciprocal(p[i], mi, vi, eps, eps_root, wd, neg_lr, bc1, bc2, False)
    m[i] = mi
    v[i] = vi


def make_bf16_spans(ahead: int, weight=adam_math.nb_weight):
  """host_compact's bfloat16 step (state in place, no decay, no copy) a span of ``SPAN`` elements at a time, the
  hash inputs an induction; with ``ahead``, each span first prefetches the lines of the span ``ahead`` spans on;
  ``weight``: ``adam_math.nb_weight`` or ``weight_reciprocal``."""

  @numba.njit(**_VOPTS)
  def bf16_spans(g, p, m, v, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, gs, key_m,
                 key_v):  # fmt: skip
    key_m, key_v = np.uint32(key_m), np.uint32(key_v)
    n = g.shape[0]
    for c in numba.prange((n + SPAN - 1) // SPAN):
      lo = c * SPAN
      nxt = lo + ahead * SPAN
      if ahead and nxt + SPAN <= n:
        _prefetch_lines(g, p, m, v, nxt, SPAN, 32)
      h_m, h_v = mf.nb_seed(lo, key_m), mf.nb_seed(lo, key_v)
      for j in range(min(SPAN, n - lo)):
        i = np.uint64(lo + j)
        mi, vi = adam_math.nb_moments(g[i] * gs, mf.nb_bf16_load(m[i]), mf.nb_bf16_load(v[i]), b1, one_minus_b1, b2,
                                      one_minus_b2)  # fmt: skip
        pn = weight(p[i], mi, vi, eps, eps_root, wd, neg_lr, bc1, bc2, False)
        m[i] = mf.nb_bf16_store(mi, mf.nb_fmix(h_m))
        v[i] = mf.nb_bf16_store(vi, mf.nb_fmix(h_v))
        p[i] = pn
        h_m, h_v = np.uint32(h_m + _CI), np.uint32(h_v + _CI)

  return bf16_spans


def make_int8(weights_first: bool, ahead: int, weight=adam_math.nb_weight):
  """host_compact's int8 step (state in place, no decay, no copy; nu's first square root in the first pass) with
  the weights in the first pass (``weights_first``: its three divides and a square root beside the decode, the
  second pass two square roots) or the second; with ``ahead``, each block first prefetches the lines of the block
  ``ahead`` blocks on; ``weight``: ``adam_math.nb_weight`` or ``weight_reciprocal``."""

  @numba.njit(**_VOPTS)
  def int8_variant(g, p, mc, mw, vc, vw, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, gs,
                   key_m, key_v):  # fmt: skip
    key_m, key_v = np.uint32(key_m), np.uint32(key_v)
    B, CHUNK = mf.BLOCK, host_compact.CHUNK
    n = g.shape[0]
    nb = (n + B - 1) // B
    base = nb * (B // 4)
    for c in numba.prange((nb + CHUNK - 1) // CHUNK):
      new_m, new_v, root_v = np.empty(B, np.float32), np.empty(B, np.float32), np.empty(B, np.float32)
      for b in range(c * CHUNK, min(nb, (c + 1) * CHUNK)):
        lo, k = b * B, min(B, n - b * B)
        nxt = lo + ahead * B
        if ahead and nxt + B <= n:
          _prefetch_lines(g, p, mc, vc, nxt, B, 64)
        old_m, old_v = mw[base + b], vw[base + b]
        top_m, top_v = np.int32(0), np.int32(0)
        for j in range(k):
          i = np.uint64(lo + j)
          mi, vi = adam_math.nb_moments(g[i] * gs, mf.nb_mu_decode(mc[i], old_m), mf.nb_nu_decode(vc[i], old_v), b1,
                                        one_minus_b1, b2, one_minus_b2)  # fmt: skip
          if weights_first:
            p[i] = weight(p[i], mi, vi, eps, eps_root, wd, neg_lr, bc1, bc2, False)
          ri = np.sqrt(vi)
          new_m[j], new_v[j], root_v[j] = mi, vi, ri
          top_m, top_v = max(top_m, host_compact._abs_bits(mi)), max(top_v, host_compact._abs_bits(ri))
        s_m, s_v = host_compact._max_of_bits(top_m), host_compact._max_of_bits(top_v)
        inv_m, inv_v = np.float32(1) / s_m, np.float32(1) / s_v
        h_m, h_v = mf.nb_seed(lo, key_m), mf.nb_seed(lo, key_v)
        for j in range(k):
          i = np.uint64(lo + j)
          if not weights_first:
            p[i] = weight(p[i], new_m[j], new_v[j], eps, eps_root, wd, neg_lr, bc1, bc2, False)
          mc[i] = mf.nb_mu_code(new_m[j], inv_m, mf.nb_unit(mf.nb_fmix(h_m)))
          vc[i] = mf.nb_nu_code_of_root(root_v[j], new_v[j], inv_v, mf.nb_unit(mf.nb_fmix(h_v)))
          h_m, h_v = np.uint32(h_m + _CI), np.uint32(h_v + _CI)
        for j in range(k, B):
          mc[lo + j] = 0
          vc[lo + j] = 0
        mw[base + b], vw[base + b] = s_m, s_v

  return int8_variant
