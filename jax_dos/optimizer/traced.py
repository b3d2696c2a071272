"""The traced update: pure XLA, for calls of ``update`` inside ``jax.jit``.

Every leaf's state is brought to the accelerator with an in-jit
``device_put`` (a no-op for resident state), updated there, and put back into
the memory kind its placement asks for. XLA schedules the copies; it does not
pipeline them (``docs/measurements.md``), which is why the eager engine exists.
This path is also the baseline the engine is measured against.

With ``delay=1`` it computes what the engine's delayed update does: from step
``delay_warmup`` on, host subgroups' updates take the parameters to the
masters *before* this step's update (with ``delay_predict="moments"``, their
``adam_math.predict_next`` from the state before this step; with
``"gradient"``, the masters after it, as undelayed AdamW).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_dos.core import adam_math
from jax_dos.memory import kinds as memory
from jax_dos.planning.plan import MEMORY_KIND


def update_leaves(
  grads: Sequence[jax.Array],
  masters: Sequence[jax.Array],
  mus: Sequence[jax.Array],
  nus: Sequence[jax.Array],
  params: Sequence[jax.Array],
  count: jax.Array,
  leaf_placements: Sequence[str],
  decay: Sequence[bool],
  hyper: adam_math.AdamHyper,
  delay: int,
  delay_warmup: int,  # no default: interleaved_adam's (10) is the only one
  grad_scale=1.0,
  new_params: bool = False,
  delay_predict: str | None = None,
):
  """Returns ``(updates, masters, mus, nus, count)`` as flat lists (the new parameters first with ``new_params``)."""
  scalars = adam_math.step_scalars(hyper, count, grad_scale)
  out = ([], [], [], [])
  for g, p32, m, v, p, placement, d in zip(grads, masters, mus, nus, params, leaf_placements, decay):
    kind = MEMORY_KIND[placement]
    g, old, m, v = (memory.traced_put(a, "device") for a in (g, p32, m, v))  # flushed gradients come back too
    stale = adam_math.predict_next(old, m, v, scalars, hyper, d) if delay_predict == "moments" else old
    u, p32, m, v = adam_math.leaf_update(g, old, m, v, p, scalars, hyper, d)
    delayed = delay and placement == "host" and delay_predict != "gradient"
    if new_params:
      u = (jnp.where(count >= delay_warmup, stale, p32) if delayed else p32).astype(p.dtype)
    elif delayed:
      u = jnp.where(count >= delay_warmup, adam_math.update_from_master(stale, p), u)
    for acc, a in zip(out, (u, memory.traced_put(p32, kind), memory.traced_put(m, kind), memory.traced_put(v, kind))):
      acc.append(a)
  return (*out, adam_math.safe_increment(count))
