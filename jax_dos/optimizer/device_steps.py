"""The accelerator side of an AdamW step: jitted calls over a subgroup's leaves, shared by every eager path.

Each call takes flat lists of a subgroup's leaves (gradients, fp32 masters,
mu, nu, parameters), the step scalars ``[-lr, 1 - b1**t, 1 - b2**t,
grad_scale]`` (``adam_math.step_scalars``) and static hyperparameters, and
applies ``adam_math.leaf_update`` leaf by leaf. State is donated, so it is
updated in place in accelerator memory. Jitted functions are cached by jax per
input signature: a plan compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_dos.core import adam_math
from jax_dos.memory import kinds as memory


def _update_group(grads, masters, mus, nus, params, scalars, hyper, decay):
  outs = [
    adam_math.leaf_update(*leaf, scalars, hyper, d) for leaf, d in zip(zip(grads, masters, mus, nus, params), decay)
  ]
  return tuple(list(x) for x in zip(*outs)) if outs else ([], [], [], [])


def _update_group_params(grads, masters, mus, nus, params, scalars, hyper, decay):
  """:func:`_update_group` returning the new parameters (new masters cast to the params' dtypes), not updates."""
  _, m32, m1, m2 = _update_group(grads, masters, mus, nus, params, scalars, hyper, decay)
  return [m.astype(p.dtype) for m, p in zip(m32, params)], m32, m1, m2


# ``update(grads, masters, mus, nus, params, scalars, hyper, decay) -> (updates, masters, mus, nus)``.
update = jax.jit(_update_group, static_argnames=("hyper", "decay"), donate_argnums=(1, 2, 3))
# The same returning the new parameters, written into the old ones' buffers. keep_unused: the old parameters are
# read for their dtype only, and jax would drop (not donate, not free) them.
update_params = jax.jit(
  _update_group_params, static_argnames=("hyper", "decay"), donate_argnums=(1, 2, 3, 4), keep_unused=True
)
scalars = jax.jit(adam_math.step_scalars, static_argnums=0)


@functools.lru_cache(maxsize=64)
def scalars_for(hyper: adam_math.AdamHyper) -> Callable[[jax.Array, Any], jax.Array]:
  """:data:`scalars` with ``hyper`` bound: ``(count, grad_scale) -> scalars``, for a caller that steps many times.
  A call then hashes no static argument (``hyper``'s ``__hash__`` runs in Python at every call of :data:`scalars`)."""
  return jax.jit(lambda count, grad_scale: adam_math.step_scalars(hyper, count, grad_scale))


increment = jax.jit(adam_math.safe_increment)
updates_from_masters = jax.jit(lambda masters, params: list(map(adam_math.update_from_master, masters, params)))
to_f32 = jax.jit(lambda x: x.astype(jnp.float32))

# The new weights written into the old parameter's buffer (donated): parameters keep their place in accelerator
# memory. Fresh arrays each step fragmented it until the next gradient step's one large temporary (18 GiB at 6.7B)
# found no room (H100).
assign = jax.jit(lambda olds, news: [n.astype(o.dtype) for o, n in zip(olds, news)], donate_argnums=0,
                 keep_unused=True)  # fmt: skip


def update_on_device(grads, masters, mus, nus, params, scalars, hyper, decay, new_params: bool = True) -> tuple:
  """AdamW on leaves whose state is in accelerator memory, in one jitted call: the gradients first brought where
  their state is (flushed ones come back from host memory), then :data:`update_params` (``new_params``: the new
  parameters written into the old ones' buffers) or :data:`update` (the updates). Every accelerator-side update
  of the eager engine and the overlapped step runs so: a call of resident leaves (``Plan.resident_call_leaves``),
  a streamed subgroup copied in (``paths.stream.step``), a fired clip's host share."""
  grads = memory.like_states(list(grads), list(masters))
  return (update_params if new_params else update)(grads, masters, mus, nus, params, scalars, hyper, decay)
