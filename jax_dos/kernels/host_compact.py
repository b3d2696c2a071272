"""The host kernel for compact moments (bfloat16, or int8 with a scale per block): ``host_kernels``' AdamW, fused.

One pass over ``g, p, m, v`` decodes the moments (``moment_formats.py``),
takes AdamW's float32 step in optax's order (``adam_math.py``) and encodes
the new moments, with the same arithmetic and random bits as the jnp path, so
the host and the accelerator give identical bits. It reads and writes
``p`` (4 + 4 B) and the moments (2 x 2 B for bfloat16, about 2 x 1 B for
int8) and reads ``g``: 20 B a parameter with float32 gradients against
``host_kernels``' 28 for float32 moments (16 with int8).

int8 takes one launch: a ``prange`` over chunks of ``CHUNK`` blocks, two
passes over each block. The first decodes the old moments at the block's
(hoisted) scales, takes the step's new moments into a scratch block
(L1-resident), nu's square roots (its code codes ``sqrt(v)``) and their maxima
as the new scales (maxima of the float bits in int32 lanes: a float max that
keeps NaN does not vectorize, and uint32 maxima ran in 64-bit lanes, half as
wide; nu's scale is the largest ``sqrt(v)``, which is ``sqrt(max v)``, the jnp
path's, as a correctly rounded square root is monotone). The second writes the weights and encodes
the new moments, each hash's input an induction (``moment_formats.nb_seed``:
``C`` more an element) rather than a product of the element's index. The
element loops index with unsigned integers: numba's negative-index wraparound
of a signed ``lo + j`` keeps LLVM from vectorizing. Each block's codes and
scale are read before they are written, so the output buffers may be the
input ones (in place).

A core's divide and square-root unit binds the second pass: a vector of lanes
takes 3 divides and a square root for the weight, 3 square roots for the codes
(on the 2-core AVX2 machine 10 ns of the unit for 8 elements, against 17-21 ns
a vector in all; on Sapphire Rapids 39 cycles against about 26 for the pass's
other 77 instructions), and the first pass had none. The split here moves
nu's first square root into the first pass (``roots_first``; the split
before, all seven in the second pass, is ``roots_first=False``): 2-7 % faster
on the AVX2 machine (within its noise), about a tenth fewer cycles by the
count for Sapphire Rapids. Of the other splits tried on the AVX2 machine, the
weights in the first pass ran 5-10 % slower (it spilled AVX2's 16 vector
registers; by the count it would balance the passes best with AVX-512's 32:
``bench/probes/host_kernel_bound.py`` times it), three loops 8 %, and one loop
taking a block's second pass with the next block's first a third slower (in
place, LLVM's aliasing checks sent it to the scalar loop).

Kernels use ``error_model="numpy"``: a zero scale gives ``1 / 0 = inf`` and
``0 inf = NaN``, encoded as 0.
"""

from __future__ import annotations

import numba
import numpy as np

from jax_dos.core import adam_math
from jax_dos.core import moment_formats as mf

B = mf.BLOCK
CHUNK = 16  # blocks a prange iteration takes: 4096 elements, against one scratch allocation
_OPTS = dict(parallel=True, nogil=True, cache=True, boundscheck=False, error_model="numpy")
_C = np.uint32(mf._C_IDX)
_ABS, _INF = np.int32(0x7FFFFFFF), np.int32(0x7F800000)


@numba.njit(inline="always")
def _bf16_element(i, g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                  neg_lr, bc1, bc2, gs, key_m, key_v, decay, load_grad, store_low, write_low, write_state):  # fmt: skip
  mi, vi = adam_math.nb_moments(load_grad(g[i]) * gs, mf.nb_bf16_load(m[i]), mf.nb_bf16_load(v[i]), b1,
                                one_minus_b1, b2, one_minus_b2)  # fmt: skip
  pn = adam_math.nb_weight(p[i], mi, vi, eps, eps_root, wd, neg_lr, bc1, bc2, decay)
  if write_state:
    m_out[i] = mf.nb_bf16_store(mi, mf.nb_hash(i, key_m))
    v_out[i] = mf.nb_bf16_store(vi, mf.nb_hash(i, key_v))
    p_out[i] = pn
  if write_low:
    low[i] = store_low(pn)


def make_bf16_kernel(load_grad, store_low):
  """The bfloat16 step: one ``prange`` over the elements (module docstring), a loop for each pair of the flags
  ``write_low`` and ``write_state`` with the flags constant in it. A flag tested inside the loop kept LLVM from
  vectorizing it (a conditional 16-bit store): 6-7x slower on two cores, the same bits."""

  @numba.njit(**_OPTS)
  def adam_bf16(g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr,
                bc1, bc2, gs, key_m, key_v, decay, write_low, write_state):  # fmt: skip
    key_m, key_v = np.uint32(key_m), np.uint32(key_v)  # 32-bit lanes (moment_formats.nb_hash)
    if write_state and write_low:
      for i in numba.prange(g.shape[0]):
        _bf16_element(i, g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                      neg_lr, bc1, bc2, gs, key_m, key_v, decay, load_grad, store_low, True, True)  # fmt: skip
    elif write_state:
      for i in numba.prange(g.shape[0]):
        _bf16_element(i, g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                      neg_lr, bc1, bc2, gs, key_m, key_v, decay, load_grad, store_low, False, True)  # fmt: skip
    elif write_low:
      for i in numba.prange(g.shape[0]):
        _bf16_element(i, g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd,
                      neg_lr, bc1, bc2, gs, key_m, key_v, decay, load_grad, store_low, True, False)  # fmt: skip

  return adam_bf16


@numba.njit(inline="always")
def _abs_bits(x):  # |x|'s bits as an int32 (>= 0): signed maxima in 32-bit lanes
  return np.int32(np.float32(x).view(np.int32) & _ABS)


@numba.njit(inline="always")
def _max_of_bits(top):  # the float of the largest |x| bits of a block; NaN (quiet) if any x was NaN
  return np.float32(np.nan) if top > _INF else np.int32(top).view(np.float32)


@numba.njit(inline="always")
def _int8_element(lo, j, p, new_m, new_v, root_v, p_out, mc_out, vc_out, low, inv_m, inv_v, eps, eps_root, wd, neg_lr,
                  bc1, bc2, h_m, h_v, decay, store_low, write_low, write_state, roots_first):  # fmt: skip
  """The second pass on element ``lo + j``: its new weight, and its codes at the new scales' reciprocals ``inv_m,
  inv_v`` with the random bits of the hash inputs ``h_m, h_v`` (``root_v[j] = sqrt(new_v[j])`` if ``roots_first``)."""
  i = np.uint64(lo + j)  # unsigned: no negative-index wraparound, which keeps LLVM from vectorizing
  pn = adam_math.nb_weight(p[i], new_m[j], new_v[j], eps, eps_root, wd, neg_lr, bc1, bc2, decay)
  if write_state:
    mc_out[i] = mf.nb_mu_code(new_m[j], inv_m, mf.nb_unit(mf.nb_fmix(h_m)))
    u_v = mf.nb_unit(mf.nb_fmix(h_v))
    if roots_first:
      vc_out[i] = mf.nb_nu_code_of_root(root_v[j], new_v[j], inv_v, u_v)
    else:
      vc_out[i] = mf.nb_nu_code(new_v[j], inv_v, u_v)
    p_out[i] = pn
  if write_low:
    low[i] = store_low(pn)


def make_int8_kernel(load_grad, store_low, roots_first=True):
  """The int8 step (module docstring): new moments, new scales, codes and weights, one block at a time.

  ``roots_first``: the first pass also takes ``sqrt(v)``, nu's scale as the largest of them (``sqrt`` is monotone
  and correctly rounded: ``max sqrt(v) = sqrt(max v)``, the jnp path's) and the second pass codes ``sqrt(v)`` from
  it: one of the second pass's seven divides and square roots moves to the first, which had none (the same bits)."""

  @numba.njit(**_OPTS)
  def adam_int8(g, p, mc, mw, vc, vw, p_out, mc_out, mw_out, vc_out, vw_out, low, b1, one_minus_b1, b2, one_minus_b2,
                eps, eps_root, wd, neg_lr, bc1, bc2, gs, key_m, key_v, decay, write_low, write_state):  # fmt: skip
    key_m, key_v = np.uint32(key_m), np.uint32(key_v)  # 32-bit lanes (moment_formats.nb_hash)
    n = g.shape[0]
    nb = (n + B - 1) // B
    base = nb * (B // 4)  # the word of block 0's scale
    for c in numba.prange((nb + CHUNK - 1) // CHUNK):
      new_m, new_v = np.empty(B, np.float32), np.empty(B, np.float32)
      root_v = np.empty(B if roots_first else 0, np.float32)
      for b in range(c * CHUNK, min(nb, (c + 1) * CHUNK)):
        lo, k = b * B, min(B, n - b * B)
        old_m, old_v = mw[base + b], vw[base + b]
        top_m, top_v = np.int32(0), np.int32(0)
        for j in range(k):
          i = np.uint64(lo + j)  # unsigned: no negative-index wraparound, which keeps LLVM from vectorizing
          m_old, v_old = mf.nb_mu_decode(mc[i], old_m), mf.nb_nu_decode(vc[i], old_v)
          mi, vi = adam_math.nb_moments(load_grad(g[i]) * gs, m_old, v_old, b1, one_minus_b1, b2, one_minus_b2)
          new_m[j], new_v[j] = mi, vi
          top_m = max(top_m, _abs_bits(mi))
          if roots_first:
            ri = np.sqrt(vi)
            root_v[j] = ri
            top_v = max(top_v, _abs_bits(ri))  # v >= 0: |sqrt(v)| = sqrt(v)
          else:
            top_v = max(top_v, _abs_bits(vi))  # v >= 0: |v| = v
        s_m = _max_of_bits(top_m)  # as jnp.max: NaN if any is NaN
        s_v = _max_of_bits(top_v) if roots_first else np.sqrt(_max_of_bits(top_v))
        inv_m, inv_v = np.float32(1) / s_m, np.float32(1) / s_v
        h_m, h_v = mf.nb_seed(lo, key_m), mf.nb_seed(lo, key_v)
        if write_state and write_low:  # each loop with its flags constant (make_bf16_kernel says why)
          for j in range(k):
            _int8_element(lo, j, p, new_m, new_v, root_v, p_out, mc_out, vc_out, low, inv_m, inv_v, eps, eps_root, wd,
                          neg_lr, bc1, bc2, h_m, h_v, decay, store_low, True, True, roots_first)  # fmt: skip
            h_m, h_v = np.uint32(h_m + _C), np.uint32(h_v + _C)
        elif write_state:
          for j in range(k):
            _int8_element(lo, j, p, new_m, new_v, root_v, p_out, mc_out, vc_out, low, inv_m, inv_v, eps, eps_root, wd,
                          neg_lr, bc1, bc2, h_m, h_v, decay, store_low, False, True, roots_first)  # fmt: skip
            h_m, h_v = np.uint32(h_m + _C), np.uint32(h_v + _C)
        elif write_low:
          for j in range(k):
            _int8_element(lo, j, p, new_m, new_v, root_v, p_out, mc_out, vc_out, low, inv_m, inv_v, eps, eps_root, wd,
                          neg_lr, bc1, bc2, h_m, h_v, decay, store_low, True, False, roots_first)  # fmt: skip
        if write_state:
          for j in range(k, B):  # the padding of the last block
            mc_out[lo + j] = 0
            vc_out[lo + j] = 0
          mw_out[base + b], vw_out[base + b] = s_m, s_v

  return adam_int8


def moments_of(dtype: str) -> str:
  """The format of a moment buffer of ``dtype`` (as ``moment_formats.stored_dtype`` gives it)."""
  return {"float32": "float32", "bfloat16": "bfloat16", "uint8": "int8"}[dtype]


def int8_views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A flat int8 moment buffer as (code bytes: uint8, words: float32), both over all its bytes."""
  flat = buf.reshape(-1).view(np.uint8)
  return flat, flat.view(np.float32)
