"""``delay_predict="gradient"``: a delayed update that hands on undelayed AdamW's weights.

With ``delay=1`` the host kernel for step ``t``'s gradients runs behind step
``t + 1``'s forward/backward pass. The weights that pass should see are
``AdamW(master, mu, nu after step t - 1; gradient of step t)``: the host has
that state (its kernel finished during step ``t``'s pass) and the accelerator
has the gradient. So, per host subgroup:

1. right after its kernel, the host worker sends copies of the new master, mu
   and nu to the accelerator, in the parameters' dtype (for bfloat16
   parameters the kernel wrote bfloat16 copies in the same pass: 6 B a
   parameter cross PCIe and are held on the accelerator through the next
   forward/backward pass; float32 parameters send their state itself), for as
   many subgroups, in plan order, as the plan's ``ahead_budget_bytes`` holds;
2. the next ``update`` takes AdamW's step there from those copies with the
   fresh gradients (``adam_math``'s arithmetic in float32) and writes the new
   weights into the old parameters' buffers. Subgroups whose copies were not
   sent ahead are sent now, a few at a time.

For float32 parameters the weights are optax's to float32 rounding; for
bfloat16 ones ``cast(master)`` up to the copies' rounding. The exact float32
step still runs on the host. Copies are only used for the very masters and
step they were made from; otherwise (a new engine, a restored state) they are
sent in ``update`` itself.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_dos import trace
from jax_dos.core import adam_math
from jax_dos.kernels import host_kernels
from jax_dos.memory import kinds as memory
from jax_dos.planning.plan import Plan

# Subgroups whose flushed gradients (or copies sent late) cross to the accelerator at once: bounded, so that the
# update needs little accelerator memory beside the state.
IN_FLIGHT = 2


def _step_group(grads, masters, mus, nus, params, scalars, hyper, decay, new_params):
  """One AdamW step from copies of host state; returns only the new parameters (or the updates to them).

  The copies may be in a lower precision than float32 (the parameters'
  dtype): they are widened, stepped in float32, and the result cast to each
  parameter's dtype (``new_params``) or turned into the update taking the
  parameter there (``adam_math.update_from_master``).
  """
  out = []
  for g, m32, m1, m2, p, d in zip(grads, masters, mus, nus, params, decay):
    f32 = [x.astype(jnp.float32) for x in (m32, m1, m2)]
    _, new, _, _ = adam_math.leaf_update(g, *f32, p, scalars, hyper, d)
    out.append(new.astype(p.dtype) if new_params else adam_math.update_from_master(new, p))
  return out


# The copies are not donated: no output has their dtype and shape to reuse them (they are freed once consumed).
_jit_step = jax.jit(_step_group, static_argnames=("hyper", "decay", "new_params"))
_jit_step_params = jax.jit(_step_group, static_argnames=("hyper", "decay", "new_params"), donate_argnums=4,
                           keep_unused=True)  # fmt: skip


class StepAhead:
  """One engine's copies for the step ahead: the kernel's bfloat16 moment copies and what was sent."""

  def __init__(self, hyper: adam_math.AdamHyper, plan: Plan, decay: Sequence[bool]):
    self.hyper, self.plan, self.decay = hyper, plan, tuple(decay)
    self.moment_copies: dict[int, tuple[jax.Array, jax.Array]] = {}  # host leaf -> bfloat16 mu, nu (bf16 params)
    self._sent: tuple | None = None  # (weak refs to the masters, step, {leaf: (master, mu, nu) on the accelerator})
    self._ahead: frozenset[int] | None = None

  def sent_ahead(self, params) -> frozenset[int]:
    """Host leaves whose copies the worker sends ahead: whole subgroups, in plan order, within the ahead budget."""
    if self._ahead is None:
      budget, leaves = self.plan.ahead_budget_bytes, []
      for s in self.plan.indices("host"):
        group = self.plan.subgroups[s]
        nbytes = sum(3 * memory.device_elements(params[i]) * jnp.dtype(params[i].dtype).itemsize for i in group)
        if budget is not None and nbytes > budget:
          break
        budget = None if budget is None else budget - nbytes
        leaves += group
      self._ahead = frozenset(leaves)
    return self._ahead

  def prepare(self, leaves: list[int], masters, mus, nus, refresh: bool) -> None:
    """Makes the host buffers for bfloat16 copies of mu and nu of ``leaves`` (bfloat16 parameters).

    With ``refresh`` they are written from the current moments (no kernel
    pass has: the first delayed step, a new state).
    """
    missing = [i for i in leaves if i not in self.moment_copies]
    made = iter(memory.zeros_like_each([(masters[i], jnp.bfloat16) for i in missing for _ in range(2)]))
    self.moment_copies.update((i, (next(made), next(made))) for i in missing)
    if refresh:
      for i in leaves:
        for copy, moment in zip(self.moment_copies[i], (mus[i], nus[i])):
          for a, b in zip(memory.shards(copy), memory.shards(moment)):
            host_kernels.round_to_bf16(a, b)

  def send(self, leaves, masters, mus, nus, lows) -> dict[int, tuple[jax.Array, jax.Array, jax.Array]]:
    """Copies of the state of ``leaves`` on the accelerator, in the parameters' dtypes: ``{leaf: (master, mu, nu)}``.

    ``lows`` holds the kernel's bfloat16 copies of the masters (bfloat16 parameters).
    """
    sent = []
    for i in leaves:
      sent += [lows.get(i, masters[i]), *self.moment_copies.get(i, (mus[i], nus[i]))]
    sent = iter(memory.put(sent, "device", likes=[masters[i] for i in leaves for _ in range(3)]))
    return {i: (next(sent), next(sent), next(sent)) for i in leaves}

  def keep(self, leaves, masters, step: int, sent: dict) -> None:
    """Holds what the worker sent, for the ``update`` of ``step`` on these very masters."""
    self._sent = ([weakref.ref(masters[i]) for i in leaves], step, sent)

  def _take(self, leaves, masters, step) -> dict:
    """What was sent ahead for this step on these very masters (some or all of ``leaves``), else nothing."""
    held, self._sent = self._sent, None
    if held is None or held[1] != step or len(held[0]) != len(leaves):
      return {}
    return held[2] if all(r() is masters[i] for r, i in zip(held[0], leaves)) else {}

  def step(self, leaves, grads, masters, mus, nus, lows, params, scalars, step, updates, new_params):
    """This step's AdamW on the accelerator for host ``leaves``, one jitted call per subgroup; the copies are consumed.

    Writes each output (new parameter, or update) into ``updates`` and
    returns them by leaf: once one is ready, whatever it read from host
    buffers has been copied.
    """
    copies = self._take(leaves, masters, step)
    pending: deque = deque()
    fn = _jit_step_params if new_params else _jit_step
    outputs = {}
    for s in self.plan.indices("host"):
      group = self.plan.subgroups[s]
      held = all(i in copies for i in group)
      flushed = any(grads[i].sharding.memory_kind in ("pinned_host", "unpinned_host") for i in group)
      if not held or flushed:
        with trace.span("device.wait_ahead"):
          while len(pending) >= IN_FLIGHT:
            jax.block_until_ready(pending.popleft())
      with trace.span("device.step_ahead" if held else "device.send_ahead"):
        here = copies if held else self.send(group, masters, mus, nus, lows)
        xs, ms, vs = (list(x) for x in zip(*[here.pop(i) for i in group]))  # popped: freed once consumed
        g = memory.like_states([grads[i] for i in group], [masters[i] for i in group])  # flushed ones come back
        outs = fn(g, xs, ms, vs, [params[i] for i in group], scalars, hyper=self.hyper,
                  decay=tuple(self.decay[i] for i in group), new_params=new_params)  # fmt: skip
        del xs, ms, vs, g
      pending.append(outs)
      for i, out in zip(group, outs):
        updates[i] = outputs[i] = out
    return outputs
