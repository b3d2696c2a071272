"""The host kernel for compact moments (bfloat16, or int8 with a scale per block): ``host_kernels``' AdamW, fused.

One pass over ``g, p, m, v`` decodes the moments (``moment_formats.py``),
takes AdamW's float32 step in optax's order (``adam_math.py``) and encodes
the new moments, with the same arithmetic and random bits as the jnp path, so
the host and the accelerator give identical bits. It reads and writes
``p`` (4 + 4 B) and the moments (2 x 2 B for bfloat16, about 2 x 1 B for
int8) and reads ``g``: 20 B a parameter with float32 gradients against
``host_kernels``' 28 for float32 moments (16 with int8).

int8 takes three launches: a ``prange`` over blocks finds the new moments'
block maxima (the new scales, into small scratch arrays), a ``prange`` over
elements recomputes each new moment (same inputs, same bits), encodes it and
writes the weights, and a last one writes the scales. Each element's code is
read before it is written and the old scales are overwritten last, so the
output buffers may be the input ones (in place). Kernels use
``error_model="numpy"``: a zero scale gives ``1 / 0 = inf`` and ``0 inf =
NaN``, encoded as 0.
"""

from __future__ import annotations

import numba
import numpy as np

from jax_dos import moment_formats as mf

B = mf.BLOCK
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


def make_int8_kernels(load_grad, store_low):
  """The int8 step as three launches: the blocks' new scales, the element-wise step, the scales written."""

  @numba.njit(**_OPTS)
  def scales(g, mc, mw, vc, vw, new_m, new_v, b1, one_minus_b1, b2, one_minus_b2, gs, mu_t, nu_t):
    n = g.shape[0]
    nb = new_m.shape[0]
    for b in numba.prange(nb):  # max |m| and sqrt(max v) of the new moments, NaN propagating (as jnp.max)
      old_m, old_v = mw[nb * (B // 4) + b], vw[nb * (B // 4) + b]
      sm, sv2, bad_m, bad_v = np.float32(0), np.float32(0), False, False
      for i in range(b * B, min(n, (b + 1) * B)):
        gi = load_grad(g[i]) * gs
        mi = one_minus_b1 * gi + b1 * mf.nb_mu_decode(mc[i], old_m, mu_t)
        vi = one_minus_b2 * (gi * gi) + b2 * mf.nb_nu_decode(vc[i], old_v, nu_t)
        sm = max(sm, abs(mi))  # a plain max; NaN is tracked beside it
        sv2 = max(sv2, vi)
        bad_m |= mi != mi
        bad_v |= vi != vi
      new_m[b] = np.float32(np.nan) if bad_m else sm
      new_v[b] = np.float32(np.nan) if bad_v else np.sqrt(sv2)

  @numba.njit(**_OPTS)
  def step(g, p, mc, mw, vc, vw, p_out, mc_out, vc_out, low, inv_m, inv_v, b1, one_minus_b1, b2, one_minus_b2, eps,
           eps_root, wd, neg_lr, bc1, bc2, gs, key_m, key_v, decay, write_low, write_state, mu_t, nu_t):  # fmt: skip
    # One prange over elements (numba's parfor lowering is what vectorizes): element i's code is byte i.
    base = inv_m.shape[0] * (B // 4)
    for i in numba.prange(g.shape[0]):
      b = i // B
      gi = load_grad(g[i]) * gs
      mi = one_minus_b1 * gi + b1 * mf.nb_mu_decode(mc[i], mw[base + b], mu_t)
      vi = one_minus_b2 * (gi * gi) + b2 * mf.nb_nu_decode(vc[i], vw[base + b], nu_t)
      u = (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps)
      pi = p[i]
      if decay:
        u = u + wd * pi
      pn = pi + neg_lr * u
      if write_state:
        mc_out[i] = mf.nb_mu_code(mi, inv_m[b], mf.nb_unit(mf.nb_hash(i, key_m)))
        vc_out[i] = mf.nb_nu_code(vi, inv_v[b], mf.nb_unit(mf.nb_hash(i, key_v)))
        p_out[i] = pn
      if write_low:
        low[i] = store_low(pn)

  return scales, step


@numba.njit(**_OPTS)
def commit_scales(n, new_m, new_v, mc_out, mw_out, vc_out, vw_out):
  """Writes the new scales, and zero codes for the padding after element ``n``."""
  nb = new_m.shape[0]
  for b in numba.prange(nb):
    mw_out[nb * (B // 4) + b] = new_m[b]
    vw_out[nb * (B // 4) + b] = new_v[b]
  for i in range(n, nb * B):
    mc_out[i] = 0
    vc_out[i] = 0


def moments_of(dtype: str) -> str:
  """The format of a moment buffer of ``dtype`` (as ``moment_formats.stored_dtype`` gives it)."""
  return {"float32": "float32", "bfloat16": "bfloat16", "uint8": "int8"}[dtype]


def int8_views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A flat int8 moment buffer as (code bytes: uint8, words: float32), both over all its bytes."""
  flat = buf.reshape(-1).view(np.uint8)
  return flat, flat.view(np.float32)
