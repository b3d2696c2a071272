"""The overlapped step's optimizer state in its plan's placements: a fresh one allocated once, or a given one moved.

Nothing is allocated twice: a fresh state is made in each subgroup's memory
kind directly, and a given state (restored, or the plain step's) moves only
the leaves whose memory kind or layout differs from the step's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dos import memory, moment_formats, partition
from jax_dos.plan import MEMORY_KIND, Plan
from jax_dos.state import InterleavedAdamState


def initial_state(
  plan: Plan, layouts: partition.StepLayouts, moments: str, leaves: list, opt_state: InterleavedAdamState | None
) -> tuple:
  """``(masters, mus, nus, count)`` in ``plan``'s placements and ``layouts``: a fresh state (``tx.init``'s: masters
  copied from ``leaves``, moments zero in the ``moments`` format), allocated once, or ``opt_state`` moved there where
  it is not."""
  placement = plan.leaf_placements()
  if opt_state is None:
    kinds = [MEMORY_KIND[p] for p in placement]
    leaves = layouts.to_state(leaves, range(len(leaves)))
    masters = [memory.copy_in(a, k) for a, k in zip(leaves, kinds)]
    mus, nus = ([moment_formats.zeros_like_in(a, k, moments) for a, k in zip(leaves, kinds)] for _ in range(2))
    return masters, mus, nus, jnp.zeros([], jnp.int32)
  place = lambda xs: [  # noqa: E731
    a if memory.memory_kind(a) == MEMORY_KIND[p] else memory.copy_in(a, MEMORY_KIND[p], a.dtype)
    for a, p in zip(xs, placement)
  ]
  # A state in another layout (the parameters', or partitioned where the step keeps the parameters') moves to the
  # step's own.
  state = (opt_state.master, opt_state.mu, opt_state.nu)
  # The count as an uncommitted scalar (as a fresh one is): a restored count is committed to one device, and the
  # step's scalars live on the mesh of the gradient scale.
  count = jnp.asarray(int(opt_state.count), jnp.int32)
  return (*(place(partition.relaid(jax.tree.leaves(t), layouts.state)) for t in state), count)
