"""Converting Adam states: ``optax.adamw`` <-> :class:`InterleavedAdamState` <-> the canonical form.

Both optimizers hold the same numbers for every parameter leaf: a step count
``t``, first moment ``mu`` and second moment ``nu``. ``interleaved_adam`` also
holds fp32 ``master`` weights; ``optax.adamw`` keeps the weights in the params
themselves. So::

    optax.adamw(lr, ..., mask=m).init(params) ==
      (ScaleByAdamState(count=t, mu, nu),
       EmptyState() | MaskedState(EmptyState()),      # weight decay; masked iff mask given
       EmptyState() | ScaleByScheduleState(count=t))  # learning rate; a schedule iff callable

and the conversions are::

    to optax:   (count, master, mu, nu) -> (ScaleByAdamState(count, mu, nu), wd, lr)    master dropped
    from optax: (ScaleByAdamState(count, mu, nu), wd, lr), params -> (count, float32(params), mu, nu)

(in ``optax.adamw`` every count is the number of updates taken, so the schedule
count equals the Adam count.) The *canonical form* used by checkpoints is the
dict ``{"count", "mu", "nu"}`` plus, when the state has them, ``"master"`` and
the leaves of any other transformation in a chain (``"extra"``); see
``checkpoint.py``. It does not depend on the plan: every leaf mirrors a
parameter leaf, in flatten order, whatever its memory kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_dos.checkpoint import moments as checkpoint_moments
from jax_dos.core import moment_formats
from jax_dos.core.state import InterleavedAdamState
from jax_dos.memory import kinds as memory
from jax_dos.optimizer.engine import wait_for_host_updates
from jax_dos.planning.plan import MEMORY_KIND, Plan

_ADAM_NODES = (InterleavedAdamState, optax.ScaleByAdamState)


def _is_node(x: Any) -> bool:
  return isinstance(x, (*_ADAM_NODES, optax.ScaleByScheduleState))


def _copy_like(x: jax.Array, like: Any, dtype=None) -> jax.Array:
  """A fresh copy of ``x`` with ``like``'s sharding (memory kind included) and dtype."""
  dtype = dtype or jnp.result_type(like)
  sharding = like.sharding if hasattr(like, "sharding") and like.sharding is not None else memory.sharding_of(x)
  return jax.device_put(jnp.asarray(x).astype(dtype), sharding, may_alias=False)


def to_optax_adamw_state(
  state: InterleavedAdamState, *, schedule: bool, masked: bool = False, memory_kind: Optional[str] = "device"
) -> tuple:
  """The ``optax.adamw`` state holding ``state``'s step count and moments.

  Args:
    state: an :class:`InterleavedAdamState` (its ``master`` is dropped: after
      ``optax.apply_updates`` the params hold the weights). Compact moments
      (``moments="bfloat16" | "int8"``) are decoded to float32.
    schedule: whether the ``optax.adamw`` it is for has a schedule as learning
      rate (then its third element is ``ScaleByScheduleState(count)``).
    masked: whether that ``optax.adamw`` was given a ``mask`` (then its second
      element is ``MaskedState(EmptyState())``).
    memory_kind: where to put ``mu`` and ``nu`` (``"device"`` for a jitted
      optax step); ``None`` leaves them where they are.

  Returns:
    ``(ScaleByAdamState(count, mu, nu), EmptyState() | MaskedState(EmptyState()),
    EmptyState() | ScaleByScheduleState(count))``, the structure of
    ``optax.adamw(...).init(params)``.
  """
  if not isinstance(state, InterleavedAdamState):
    raise TypeError(f"to_optax_adamw_state takes an InterleavedAdamState, got {type(state).__name__}.")
  wait_for_host_updates()
  move = (lambda x: memory.copy_in(x, memory_kind)) if memory_kind else (lambda x: x)
  mu, nu = (jax.tree.map(move, _float32_moments(t, state.master, salt)) for salt, t in enumerate((state.mu, state.nu)))
  decay_state = optax.MaskedState(inner_state=optax.EmptyState()) if masked else optax.EmptyState()
  count = jnp.asarray(state.count, jnp.int32)
  lr_state = optax.ScaleByScheduleState(count=jnp.array(count, copy=True)) if schedule else optax.EmptyState()
  return (optax.ScaleByAdamState(count=count, mu=mu, nu=nu), decay_state, lr_state)


def _float32_moments(moments: Any, masters: Any, salt: int) -> Any:
  """Compact moments (``interleaved_adam(moments=...)``) decoded to float32, placed as the masters; else as they are."""
  fmt = checkpoint_moments.tree_format(moments)[0]
  if fmt == "float32":
    return moments

  def one(x, master):
    values = moment_formats.host_decode(np.asarray(x), int(np.size(master)), fmt, salt).reshape(np.shape(master))
    return jax.device_put(values, master.sharding)

  return jax.tree.map(one, moments, masters)


def from_optax_adamw_state(
  adamw_state: Any, params: optax.Params, *, plan: Optional[Plan] = None
) -> InterleavedAdamState:
  """The :class:`InterleavedAdamState` continuing an ``optax.adamw`` run.

  Args:
    adamw_state: ``optax.adamw(...).init(params)``-shaped state (or any state
      containing exactly one ``ScaleByAdamState``).
    params: the current parameters; the master weights are ``float32(params)``.
    plan: if given (``jax_dos.get_plan(tx, params)``), every leaf is placed in
      the memory kind of its subgroup's placement; otherwise master stays next
      to the params and mu/nu where they are (the engine moves them on the
      first eager update).
  """
  found = [x for x in jax.tree.leaves(adamw_state, is_leaf=_is_node) if isinstance(x, optax.ScaleByAdamState)]
  if len(found) != 1:
    raise ValueError(
      f"expected an optax.adamw state with exactly one ScaleByAdamState, found {len(found)};"
      " pass the state made by optax.adamw(...).init (or optax.adam)."
    )
  adam = found[0]
  p_leaves, pdef = jax.tree.flatten(params)
  for name, tree in (("mu", adam.mu), ("nu", adam.nu)):
    if jax.tree.structure(tree) != pdef:
      raise ValueError(
        f"the optax state's {name} tree does not match params.\n  {name}: {jax.tree.structure(tree)}\n  params: {pdef}"
      )
  if plan is None:
    kinds = [None] * len(p_leaves)
  else:
    if plan.num_leaves != len(p_leaves):
      raise ValueError(
        f"the plan covers {plan.num_leaves} leaves but params have {len(p_leaves)}; make the plan for these params."
      )
    kinds = [MEMORY_KIND[p] for p in plan.leaf_placements()]

  def place(xs):  # fresh float32 copies, never aliases of the inputs
    return jax.tree.unflatten(
      pdef, [memory.copy_in(x, k or memory.memory_kind(x) or "device") for x, k in zip(xs, kinds, strict=True)]
    )

  master, mu, nu = place(p_leaves), place(jax.tree.leaves(adam.mu)), place(jax.tree.leaves(adam.nu))
  return InterleavedAdamState(jnp.array(adam.count, jnp.int32, copy=True), master, mu, nu)


@dataclasses.dataclass
class AdamParts:
  """An optimizer state taken apart around its (single) Adam state.

  Attributes:
    kind: ``"interleaved"`` (an :class:`InterleavedAdamState`) or ``"optax"``
      (a ``ScaleByAdamState``).
    count, mu, nu, master: the Adam state's fields (``master`` is ``None`` for optax).
    extra: every other array leaf of the state, in flatten order (e.g. a chained
      transformation's state); ``ScaleByScheduleState`` counts are not extra:
      they equal ``count``.
    rebuild: ``rebuild(count, master, mu, nu, extra)`` makes a state of the same
      structure from new parts (``master`` ignored for optax; each schedule count
      becomes a copy of ``count``).
  """

  kind: str
  count: Any
  mu: Any
  nu: Any
  master: Any
  extra: list
  rebuild: Any


def split_adam(opt_state: Any) -> AdamParts:
  """Finds the one Adam state inside ``opt_state`` (possibly in an ``optax.chain`` tuple)."""
  nodes, treedef = jax.tree.flatten(opt_state, is_leaf=_is_node)
  adam_at = [i for i, x in enumerate(nodes) if isinstance(x, _ADAM_NODES)]
  if len(adam_at) != 1:
    raise ValueError(
      f"the optimizer state must contain exactly one Adam state (jax_dos.InterleavedAdamState or optax's"
      f" ScaleByAdamState), found {len(adam_at)} in {type(opt_state).__name__}. Checkpoint other optimizers with"
      " orbax directly."
    )
  a = nodes[adam_at[0]]
  kind = "interleaved" if isinstance(a, InterleavedAdamState) else "optax"
  extra_at = [i for i, x in enumerate(nodes) if not _is_node(x)]
  sched_at = [i for i, x in enumerate(nodes) if isinstance(x, optax.ScaleByScheduleState)]

  def rebuild(count, master, mu, nu, extra):
    out = list(nodes)
    if kind == "interleaved":
      out[adam_at[0]] = InterleavedAdamState(count, master, mu, nu)
    else:
      out[adam_at[0]] = optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
    for i in sched_at:
      out[i] = optax.ScaleByScheduleState(count=_copy_like(count, nodes[i].count))
    if len(extra) != len(extra_at):
      raise ValueError(f"expected {len(extra_at)} extra optimizer-state leaves, got {len(extra)}.")
    for i, x in zip(extra_at, extra, strict=True):
      out[i] = x
    return jax.tree.unflatten(treedef, out)

  master = a.master if kind == "interleaved" else None
  return AdamParts(kind, a.count, a.mu, a.nu, master, [nodes[i] for i in extra_at], rebuild)
