"""The overlapped step's optimizer state in its plan's placements: a fresh one allocated once, or a given one moved.

Nothing is allocated twice: a fresh state is made in each subgroup's memory
kind directly, and a given state (restored, or the plain step's) moves only
the leaves whose memory kind or layout differs from the step's. With a
:class:`~jax_dos.memory.pinned_arena.PinnedArena`, the offloaded leaves' state lives
in it, outside XLA's pinned pool: a fresh master is copied there from the
accelerator (:class:`~jax_dos.memory.copy_out.CopyOut`), fresh moments are its zero
pages; a given offloaded leaf on the accelerator is copied in, and one in
XLA's pool stays there (the host and stream paths write it in place as they
write the arena's). A given leaf in ordinary host memory (``unpinned_host``: a
restore into ``abstract_state(..., host_kind="unpinned_host")``) is written
into its placement, the arena's where there is one, and deleted, one leaf at a
time: the process holds the state about once. :class:`PinnedMemory` is where
that memory comes from.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos.core import moment_formats, partition
from jax_dos.core.state import InterleavedAdamState
from jax_dos.hand_off import receive
from jax_dos.memory import host_copies, pinned_arena
from jax_dos.memory import kinds as memory
from jax_dos.memory.copy_out import CopyOut
from jax_dos.memory.pinned_arena import PinnedArena
from jax_dos.planning import calibration
from jax_dos.planning.plan import MEMORY_KIND, Plan

PINNED_MEMORY = ("auto", "arena", "pool")  # OverlappedStep(pinned_memory=...): our own mapping, or XLA's pinned pool


class PinnedMemory:
  """Where an overlapped step's offloaded state lives: a :class:`PinnedArena` and the copies into it (the stream
  path's new state, the host leaves' gradients), or XLA's pinned pool (``arena is None``).

  ``mode``: ``"arena"``, ``"pool"``, or ``"auto"``: the arena, unless XLA's pool holds pinned memory for good
  already (docs/overlap.md, "Pinned memory of our own"): this process measured the planner's calibration on an
  accelerator, or the given state has offloaded leaves in it (``given_in_pool``: ``tx.init``'s, a restored one; its
  regions would stay beside an arena that the step's new state moves into); the pool on backends the arena does not
  serve (``pinned_arena.supported``).
  """

  def __init__(self, mode: str, devices: Sequence[jax.Device], given_in_pool: bool = False):
    pool_grown = calibration.measured_in_this_process() or given_in_pool
    own = pinned_arena.supported(devices) and (mode == "arena" or (mode == "auto" and not pool_grown))
    self.arena = PinnedArena(sorted(set(devices), key=lambda d: d.id)) if own else None
    self.state_out = CopyOut("jax_dos-state-out") if own else None  # (stream worker) its new state
    # (training thread) the host leaves' gradients (``paths.host.gradients_to_host``)
    self.grads_out = CopyOut("jax_dos-grads-out") if own else None

  @classmethod
  def for_step(cls, mode: str, params: list[jax.Array], opt_state: InterleavedAdamState | None) -> PinnedMemory:
    """The pinned memory of a step over ``params`` (their devices) given ``opt_state`` (its offloaded leaves in XLA's
    pool or not)."""
    devices = [d for x in params for d in x.sharding.addressable_devices]
    given_in_pool = opt_state is not None and any(
      memory.memory_kind(x) == "pinned_host" for x in jax.tree.leaves(opt_state.master)
    )
    return cls(mode, devices, given_in_pool)

  def close(self) -> None:
    """Waits for the copies requested and ends their workers."""
    for copier in (self.state_out, self.grads_out):
      if copier is not None:
        copier.close()


def unpinned_bytes(opt_state: InterleavedAdamState | None) -> int:
  """Bytes of ``opt_state`` in ``unpinned_host`` memory: what :func:`initial_state` frees as it moves them."""
  leaves = [] if opt_state is None else jax.tree.leaves(opt_state)
  return sum(x.nbytes for x in leaves if memory.memory_kind(x) == "unpinned_host")


def check_given(opt_state: InterleavedAdamState | None, treedef: jax.tree_util.PyTreeDef) -> None:
  """A ``TypeError`` or ``ValueError`` that says what to pass where ``opt_state`` is neither ``None`` nor an
  ``InterleavedAdamState`` whose master and moments have the parameters' structure ``treedef``."""
  if opt_state is None:
    return
  if not isinstance(opt_state, InterleavedAdamState):
    raise TypeError(
      f"opt_state must be the InterleavedAdamState of tx.init(params), or None for a fresh one, got"
      f" {type(opt_state).__name__}."
    )
  for name, tree in (("master", opt_state.master), ("mu", opt_state.mu), ("nu", opt_state.nu)):
    if jax.tree.structure(tree) != treedef:
      raise ValueError(
        f"opt_state.{name} does not match params: pass tx.init(params), a state restored for them, or None."
      )


def initial_state(
  plan: Plan, relayout: partition.ParamStateLayouts, moments: str, leaves: list, opt_state: InterleavedAdamState | None,
  arena: PinnedArena | None = None, copier: CopyOut | None = None,
) -> tuple:  # fmt: skip
  """``(masters, mus, nus, count)`` in ``plan``'s placements and ``relayout``: a fresh state (``tx.init``'s: masters
  copied from ``leaves``, moments zero in the ``moments`` format), allocated once, or ``opt_state`` moved there where
  it is not; the offloaded leaves in ``arena`` if given (``copier`` copying into it from the accelerator). A given
  leaf in ``unpinned_host`` memory is consumed: written into its placement and deleted (:func:`_adopted`), once every
  such leaf has been checked (:func:`_target`)."""
  placement = plan.leaf_placements()
  kinds = [MEMORY_KIND[p] for p in placement]
  if opt_state is None:
    leaves = relayout.to_state(leaves, range(len(leaves)))
    if arena is None:
      masters = [memory.copy_in(a, k) for a, k in zip(leaves, kinds)]
      mus, nus = ([moment_formats.zero_moment_like(a, k, moments) for a, k in zip(leaves, kinds)] for _ in range(2))
      return masters, mus, nus, jnp.zeros([], jnp.int32)
    masters = [memory.copy_in(a, "device") if k == "device" else None for a, k in zip(leaves, kinds)]
    for i in (i for i, k in enumerate(kinds) if k != "device"):  # one leaf at a time in accelerator memory
      f32 = memory.copy_in(leaves[i], "device")
      masters[i] = receive(copier.submit([f32], [arena.array_like(f32)], free_sources=True), None, "a master")[0]
    mus, nus = (
      [moment_formats.zero_moment_like(a, k, moments) if k == "device" else arena.zeros_like(
        moment_formats.moment_struct(a, moments)) for a, k in zip(leaves, kinds)]
      for _ in range(2)
    )  # fmt: skip
    return masters, mus, nus, jnp.zeros([], jnp.int32)

  def move(a: jax.Array, kind: str) -> jax.Array:
    if memory.memory_kind(a) == kind:  # in XLA's pool (restored there, or tx.init's) it stays: a copy would hold
      return a  # it twice until its caller dropped it
    if arena is not None and kind != "device":
      return receive(copier.submit([a], [arena.array_like(a)]), None, "a state leaf")[0]
    return memory.copy_in(a, kind, a.dtype)

  place = lambda xs: [move(a, k) for a, k in zip(xs, kinds)]  # noqa: E731
  # Leaves in ordinary host memory go to their placements first, one at a time, each freed as it lands; a state in
  # another layout (the parameters', or partitioned where the step keeps the parameters') then moves to the step's.
  given = [  # (leaf, its target where it is in ordinary memory): every such leaf checked before any moves
    [(x, _target(x, relayout.state[i], kinds[i], fmt)) for i, x in enumerate(jax.tree.leaves(tree))]
    for tree, fmt in zip((opt_state.master, opt_state.mu, opt_state.nu), ("float32", moments, moments))
  ]
  state = [[x if t is None else _adopted(x, t, arena) for x, t in row] for row in given]
  # The count as an uncommitted scalar (as a fresh one is): a restored count is committed to one device, and the
  # step's scalars live on the mesh of the gradient scale.
  count = jnp.asarray(int(opt_state.count), jnp.int32)
  return (*(place(partition.relaid(xs, relayout.state)) for xs in state), count)


def _target(x: jax.Array, param: jax.ShapeDtypeStruct, kind: str, fmt: str) -> jax.ShapeDtypeStruct | None:
  """Where ``x``, a given leaf in ``unpinned_host`` memory (whole, a restore's), goes: the step's layout (``param``'s),
  the state's format ``fmt`` and memory ``kind``; ``None`` for a leaf elsewhere. A ``ValueError`` where ``x`` is not
  that leaf's shape and dtype."""
  if memory.memory_kind(x) != "unpinned_host":
    return None
  st = moment_formats.moment_struct(param, fmt)  # the leaf as the step keeps it ("float32": the master)
  if (tuple(x.shape), x.dtype) != (tuple(st.shape), st.dtype):
    raise ValueError(
      f"a given state leaf in unpinned_host memory is {x.dtype}{tuple(x.shape)} where the step keeps"
      f" {st.dtype}{tuple(st.shape)}: restore into jax_dos.abstract_state(plan, params, moments,"
      " host_kind='unpinned_host') with the step's plan and moments."
    )
  return jax.ShapeDtypeStruct(st.shape, st.dtype, sharding=st.sharding.with_memory_kind(kind))


def _adopted(x: jax.Array, target: jax.ShapeDtypeStruct, arena: PinnedArena | None) -> jax.Array:
  """``x``'s values in an array of ``target``'s layout and memory (:func:`_placed`); ``x`` is then deleted, which
  frees its memory."""
  out = _placed(np.asarray(x), target, arena)  # np.asarray: a view of x's memory, dropped before x is deleted
  x.delete()
  return out


def _placed(values: np.ndarray, target: jax.ShapeDtypeStruct, arena: PinnedArena | None) -> jax.Array:
  """``values`` in an array laid out and placed as ``target``: the arena's where it serves ``target``'s host memory."""
  if arena is not None and target.sharding.memory_kind != "device":
    out = arena.array_like(target)
    host_copies.fill(out, values)
    return out
  return jax.make_array_from_callback(target.shape, target.sharding, lambda index: values[index])
