"""The AdamW arithmetic, written once, in exactly ``optax.adamw``'s order.

For a leaf with gradient ``g``, fp32 master weights ``p``, moments ``m, v``,
step ``t = count + 1`` (optax's ``safe_increment``) and gradient scale ``s``
(``1`` unless the caller passes ``grad_scale``, e.g. a global-norm clip)::

    g   <- s * g
    m   <- (1 - b1) * g + b1 * m
    v   <- (1 - b2) * g**2 + b2 * v
    u   <- (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t) + eps_root) + eps)
    u   <- u + wd * p                       (wd = 0 where ``mask`` is False)
    u   <- (-lr(count)) * u
    p   <- p + u

All in float32. With compact moments (``moments="bfloat16"`` or ``"int8"``)
``m`` and ``v`` are decoded to float32 first and the new ones encoded after
(``moment_formats.py``); the step's seed for their stochastic rounding is a
fifth scalar. The per-step scalars ``(-lr, 1 - b1**t, 1 - b2**t, s)`` are
computed by :func:`step_scalars` with the same XLA ops optax uses, so the host
kernel (``host_kernels.py``) receives bit-identical values. The update handed
back to the caller is ``u`` for float32 parameters, and
``cast(p_new, dtype) - param`` (in float32) for lower-precision parameters, so
that ``optax.apply_updates`` yields exactly the new master cast to the
parameter's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Union

import jax
import jax.numpy as jnp
import numba
import numpy as np

from jax_dos.core import moment_formats

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]


@dataclasses.dataclass(frozen=True)
class AdamHyper:
  """Hyperparameters of AdamW, as in ``optax.adamw``."""

  learning_rate: ScalarOrSchedule
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  weight_decay: float = 0.0
  moments: str = "float32"  # how mu and nu are stored: moment_formats.FORMATS


def step_scalars(hyper: AdamHyper, count: jax.Array, grad_scale: Any = 1.0) -> jax.Array:
  """``[-lr(count), 1 - b1**(count+1), 1 - b2**(count+1), grad_scale]`` as float32[4].

  With compact moments a fifth: the seed of their rounding (``moment_formats.step_seed``).
  """
  count_inc = safe_increment(count)
  lr = hyper.learning_rate(count) if callable(hyper.learning_rate) else hyper.learning_rate
  neg_lr = jnp.asarray(-1 * lr, dtype=jnp.float32)
  bc1 = 1 - hyper.b1**count_inc
  bc2 = 1 - hyper.b2**count_inc
  scale = jnp.asarray(grad_scale, jnp.float32)
  seed = [moment_formats.step_seed(count_inc)] if hyper.moments != "float32" else []
  return jnp.stack([neg_lr, bc1.astype(jnp.float32), bc2.astype(jnp.float32), scale, *seed])


def clip_scale(grad_norm: Any, max_norm: float) -> jax.Array:
  """The factor ``optax.clip_by_global_norm(max_norm)`` applies to gradients of norm ``grad_norm``.

  ``1`` if ``grad_norm < max_norm``, else ``max_norm / grad_norm`` (float32). Pass it as ``grad_scale``.
  """
  grad_norm = jnp.asarray(grad_norm, jnp.float32)
  return jnp.where(grad_norm < max_norm, jnp.float32(1), jnp.float32(max_norm) / grad_norm)


def safe_increment(count: jax.Array) -> jax.Array:
  """``count + 1``, saturating at the dtype's maximum (optax's rule)."""
  max_value = jnp.iinfo(count.dtype).max
  return jnp.where(count < max_value, count + 1, max_value).astype(count.dtype)


def leaf_update(
  grad: jax.Array,
  master: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  param: jax.Array,
  scalars: jax.Array,
  hyper: AdamHyper,
  decay: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """One leaf's AdamW step. Returns ``(update, master, mu, nu)``, the moments stored as ``hyper.moments`` says."""
  fmt = hyper.moments
  if fmt != "float32":
    mu = moment_formats.decode(mu, master.shape, fmt, 0)
    nu = moment_formats.decode(nu, master.shape, fmt, 1)
  g = grad.astype(jnp.float32) * scalars[3]
  mu = (1 - hyper.b1) * g + hyper.b1 * mu
  nu = (1 - hyper.b2) * (g**2) + hyper.b2 * nu
  mu_hat = mu / scalars[1]
  nu_hat = nu / scalars[2]
  u = mu_hat / (jnp.sqrt(nu_hat + hyper.eps_root) + hyper.eps)
  if decay:
    u = u + hyper.weight_decay * master
  u = scalars[0] * u
  master = master + u
  if fmt != "float32":
    mu = moment_formats.encode(mu, fmt, scalars[4], 0)
    nu = moment_formats.encode(nu, fmt, scalars[4], 1)
  return to_param_update(u, master, param), master, mu, nu


def predict_next(
  master: jax.Array, mu: jax.Array, nu: jax.Array, scalars: jax.Array, hyper: AdamHyper, decay: bool
) -> jax.Array:
  """The weights one more AdamW step would give if it left the moments as they are (float32).

  ``p + (-lr) (m / (1 - b1**t) / (sqrt(v / (1 - b2**t) + eps_root) + eps) + wd p)``
  with the step's ``scalars``: what ``delay_predict`` hands the forward pass in
  place of the stale masters (see ``interleaved_adam``). The host kernel
  computes it in this order, in float32.
  """
  u = (mu / scalars[1]) / (jnp.sqrt(nu / scalars[2] + hyper.eps_root) + hyper.eps)
  if decay:
    u = u + hyper.weight_decay * master
  return master + scalars[0] * u


# ----------------------------------------------------------------------------- numba (every host kernel)
# The same two steps on float32 scalars, inlined into every host kernel (host_kernels.py, host_compact.py), so the
# arithmetic is written once for the host. Every argument is float32: nothing is promoted to float64.


@numba.njit(inline="always")
def nb_moments(g, m, v, b1, one_minus_b1, b2, one_minus_b2):
  """The new ``(m, v)`` from the scaled gradient ``g`` and the old (decoded) moments."""
  return one_minus_b1 * g + b1 * m, one_minus_b2 * (g * g) + b2 * v


@numba.njit(inline="always")
def nb_weight(p, m, v, eps, eps_root, wd, neg_lr, bc1, bc2, decay):
  """``p + neg_lr (m / bc1 / (sqrt(v / bc2 + eps_root) + eps) + wd p)``: the new weight, or with the next step's
  scalars :func:`predict_next`'s."""
  u = (m / bc1) / (np.sqrt(v / bc2 + eps_root) + eps)
  if decay:
    u = u + wd * p
  return p + neg_lr * u


def update_from_master(master: jax.Array, param: Any) -> jax.Array:
  """The update taking ``param`` to ``master`` cast to its dtype, from the new master alone.

  Used where only the new master reaches the accelerator (host subgroups). For
  float32 it equals ``u`` wherever ``p`` and ``p + u`` are within a factor of
  two (Sterbenz), i.e. everywhere but where a step moves a weight past twice
  its size; there it differs from optax's by float32 rounding of the weight.
  """
  param = jnp.asarray(param)
  return master.astype(param.dtype).astype(jnp.float32) - param.astype(jnp.float32)


def to_param_update(u: jax.Array, master: jax.Array, param: Any) -> jax.Array:
  """The update that takes ``param`` to ``master`` cast to ``param``'s dtype."""
  if jnp.result_type(param) == jnp.float32:
    return u
  return update_from_master(master, param)
