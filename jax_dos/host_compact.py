"""The host kernel for compact moments (bfloat16, or int8 with a scale per block): ``host_kernels``' AdamW, fused.

One pass over ``g, p, m, v`` decodes the moments (``moment_formats.py``),
takes AdamW's float32 step in optax's order (``adam_math.py``) and encodes
the new moments, with the same arithmetic and random bits as the jnp path, so
the host and the accelerator give identical bits. It reads and writes
``p`` (4 + 4 B) and the moments (2 x 2 B for bfloat16, about 2 x 1 B for
int8) and reads ``g``: 20 B a parameter with float32 gradients against
``host_kernels``' 28 for float32 moments (16 with int8).

int8 works block by block (one ``prange`` over blocks): a first loop finds
the new moments' block maxima (the new scales), a second recomputes each new
moment (same inputs, same bits), encodes it and writes the weights. Every
element's old code and its block's old scale are read before they are
written, so the output buffers may be the input ones (in place). Kernels use
``error_model="numpy"``: a zero scale gives ``0 / 0 = NaN``, encoded as 0.
"""

from __future__ import annotations

import numba
import numpy as np

from jax_dos import moment_formats as mf

B = mf.BLOCK
_ROW = (B + 4) // 4  # float32 words a block's row takes: its codes, then its scale
_OPTS = dict(parallel=True, nogil=True, cache=True, boundscheck=False, error_model="numpy")


def make_bf16_kernel(load_grad, store_low):
  @numba.njit(**_OPTS)
  def adam_bf16(g, p, m, v, p_out, m_out, v_out, low, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, wd, neg_lr,
                bc1, bc2, gs, key_m, key_v, decay, write_low, write_state):  # fmt: skip
    for i in numba.prange(g.shape[0]):
      gi = load_grad(g[i]) * gs
      mi = one_minus_b1 * gi + b1 * mf.nb_bf16_load(m[i])
      vi = one_minus_b2 * (gi * gi) + b2 * mf.nb_bf16_load(v[i])
      u = (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps)
      pi = p[i]
      if decay:
        u = u + wd * pi
      pn = pi + neg_lr * u
      if write_state:
        m_out[i] = mf.nb_bf16_store(mi, mf.nb_hash(i, key_m))
        v_out[i] = mf.nb_bf16_store(vi, mf.nb_hash(i, key_v))
        p_out[i] = pn
      if write_low:
        low[i] = store_low(pn)

  return adam_bf16


def make_int8_kernel(load_grad, store_low):
  @numba.njit(**_OPTS)
  def adam_int8(g, p, mc, ms, vc, vs, p_out, mc_out, ms_out, vc_out, vs_out, low, b1, one_minus_b1, b2,
                one_minus_b2, eps, eps_root, wd, neg_lr, bc1, bc2, gs, key_m, key_v, decay, write_low,
                write_state, mu_t, nu_t):  # fmt: skip
    n = g.shape[0]
    for b in numba.prange((n + B - 1) // B):
      row, lo, hi = b * (B + 4), b * B, min(n, (b + 1) * B)
      old_m, old_v = ms[b * _ROW + B // 4], vs[b * _ROW + B // 4]
      sm, sv = np.float32(0), np.float32(0)
      for i in range(lo, hi):  # the new scales: max |m| and max sqrt(v), NaN propagating (as jnp.max)
        gi = load_grad(g[i]) * gs
        mi = one_minus_b1 * gi + b1 * mf.nb_mu_decode(mc[row + i - lo], old_m, mu_t)
        vi = one_minus_b2 * (gi * gi) + b2 * mf.nb_nu_decode(vc[row + i - lo], old_v, nu_t)
        a, t = abs(mi), np.sqrt(vi)
        if sm == sm and not a <= sm:
          sm = a
        if sv == sv and not t <= sv:
          sv = t
      for i in range(lo, hi):
        gi = load_grad(g[i]) * gs
        mi = one_minus_b1 * gi + b1 * mf.nb_mu_decode(mc[row + i - lo], old_m, mu_t)
        vi = one_minus_b2 * (gi * gi) + b2 * mf.nb_nu_decode(vc[row + i - lo], old_v, nu_t)
        u = (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps)
        pi = p[i]
        if decay:
          u = u + wd * pi
        pn = pi + neg_lr * u
        if write_state:
          mc_out[row + i - lo] = mf.nb_mu_code(mi, sm, mf.nb_unit(mf.nb_hash(i, key_m)))
          vc_out[row + i - lo] = mf.nb_nu_code(vi, sv, mf.nb_unit(mf.nb_hash(i, key_v)))
          p_out[i] = pn
        if write_low:
          low[i] = store_low(pn)
      if write_state:
        for j in range(hi - lo, B):  # padding: zeros, code 0
          mc_out[row + j] = 0
          vc_out[row + j] = 0
        ms_out[b * _ROW + B // 4] = sm
        vs_out[b * _ROW + B // 4] = sv

  return adam_int8


def moments_of(dtype: str) -> str:
  """The format of a moment buffer of ``dtype`` (as ``moment_formats.stored_dtype`` gives it)."""
  return {"float32": "float32", "bfloat16": "bfloat16", "uint8": "int8"}[dtype]


def int8_views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A flat int8 moment buffer as (code bytes: uint8, words: float32), both over all its bytes."""
  flat = buf.reshape(-1).view(np.uint8)
  return flat, flat.view(np.float32)
