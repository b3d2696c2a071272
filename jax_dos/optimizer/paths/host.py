"""The host mechanic: gradients to pinned host memory, the fused host kernel over a subgroup's shards, new weights sent.

One implementation for the eager engine (``Engine._host_worker``) and the overlapped step's host path
(``overlap.host_path.HostPath``):

* :func:`gradients_to_host`: a host subgroup's gradients on their way to pinned host memory, in a dtype the kernel
  reads (float32 or bfloat16 as they are, others cast on the accelerator first); those flushed there already stay;
* :class:`Kernel`: ``host_kernels.adam_many`` (in place) or ``adam_many_into`` (into spare buffers) over the
  single-device shards of a subgroup's leaves, with one optimizer's hyperparameters and weight-decay flags;
* :func:`send`: the new weights the kernel wrote (a bfloat16 or float32 copy of each master) on their way to
  accelerator memory, laid out as the parameters.

Where the two callers differ, the caller decides:

* the engine steps the state in place, dispatches each subgroup's update program at once behind its copy, and waits
  for every copy before its worker returns (with ``delay``, ``write_behind`` and ``delay_predict`` it sends old or
  predicted weights, or writes the state in a second pass);
* the host path steps into its spare state (a speculation must leave the state untouched until the clip decision),
  dispatches the program that writes the new weights in place only once their copy has landed (a program whose input
  is in flight would hold the compute queue), and with a :class:`~jax_dos.memory.pinned_arena.PinnedArena` takes the
  gradients into arena buffers through a :class:`~jax_dos.memory.copy_out.CopyOut`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from jax_dos.kernels import host_kernels
from jax_dos.memory import kinds as memory
from jax_dos.memory.copy_out import CopyOut
from jax_dos.memory.pinned_arena import PinnedArena
from jax_dos.optimizer import device_steps


def _readable(g: jax.Array) -> jax.Array:
  return g if str(g.dtype) in host_kernels.GRAD_DTYPES else device_steps.to_f32(g)


def gradients(grads: list[jax.Array], masters: list[jax.Array], leaves: list[int]) -> dict[int, jax.Array]:
  """Gradients of the host leaves in XLA's ``pinned_host`` memory, laid out as their masters (copied there unless
  flushed already). ``grads`` and ``masters``: lists over every leaf, read at ``leaves``.

  A gradient flushed to the host in a dtype the kernel does not read is refused before anything moves.
  """
  flushed, to_copy = [], []
  for i in leaves:
    g = grads[i]
    if g.sharding.memory_kind == "pinned_host":
      if str(g.dtype) not in host_kernels.GRAD_DTYPES:
        raise TypeError(
          f"gradient leaf {i} is in pinned_host memory as {g.dtype}; the host kernel reads"
          f" {' or '.join(host_kernels.GRAD_DTYPES)}. Cast it before it leaves the accelerator."
        )
      flushed.append(i)
    else:
      to_copy.append(i)
  landed = memory.like_states([grads[i] for i in flushed], [masters[i] for i in flushed], "pinned_host")
  out = dict(zip(flushed, landed))
  on_device = memory.like_states([grads[i] for i in to_copy], [masters[i] for i in to_copy])
  out.update(zip(to_copy, memory.put([_readable(g) for g in on_device], "pinned_host")))
  return out


def gradients_to_host(
  grads: list[jax.Array], leaves: list[int], arena: PinnedArena | None = None, copier: CopyOut | None = None
) -> dict[int, jax.Array] | Future:
  """One subgroup's gradients (``grads``, of ``leaves``, laid out as their state) on their way to pinned host memory:
  into XLA's pool (``leaf -> gradient``, :func:`gradients`), or with ``arena`` into new arena buffers that ``copier``
  writes (the copy's future of them, in ``leaves``' order: a ``HandOff`` the receiver takes)."""
  if arena is None:
    out = gradients(grads, grads, list(range(len(grads))))  # laid out as their state already
    return {i: out[j] for j, i in enumerate(leaves)}
  grads = [_readable(g) for g in grads]
  return copier.submit(grads, [arena.array_like(g) for g in grads])


class Kernel:
  """The fused host kernel over subgroups' shards, with one optimizer's hyperparameters and decay flags (per leaf).

  ``arrays(i)`` names leaf ``i``'s buffers in the kernel's order (``host_kernels.adam_many``:
  ``(g, p, m, v[, low[, low_m, low_v]])``; ``adam_many_into``: ``(g, p, m, v, p_out, m_out, v_out, low)``); a leaf
  of several shards is stepped shard by shard.
  """

  def __init__(self, hyper: Any, decay: tuple[bool, ...]):
    self.decay = decay
    self._kw = dict(b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root, weight_decay=hyper.weight_decay)

  def _shards(self, leaves: Iterable[int], arrays: Callable[[int], tuple]) -> tuple[list[tuple], list[bool]]:
    buffers, decay = [], []
    for i in leaves:
      for shards in zip(*(memory.shards(a) for a in arrays(i))):
        buffers.append(shards)
        decay.append(self.decay[i])
    return buffers, decay

  def step(
    self, leaves: Iterable[int], arrays: Callable[[int], tuple], scalars: np.ndarray,
    next_scalars: np.ndarray | None = None, write_state: bool = True,
  ) -> None:  # fmt: skip
    """AdamW in place on ``leaves``' buffers (``host_kernels.adam_many``, whose arguments the others are)."""
    host_kernels.adam_many(*self._shards(leaves, arrays), **self._kw, scalars=scalars, next_scalars=next_scalars,
                           write_state=write_state)  # fmt: skip

  def step_into(self, leaves: Iterable[int], arrays: Callable[[int], tuple], scalars: np.ndarray) -> None:
    """AdamW from ``leaves``' state into their spare buffers (``host_kernels.adam_many_into``)."""
    host_kernels.adam_many_into(*self._shards(leaves, arrays), **self._kw, scalars=scalars)


def send(weights: list[jax.Array], params: list[jax.Array]) -> list[jax.Array]:
  """The new weights the kernel wrote (host buffers) on their way to accelerator memory, laid out as ``params``: one
  batched copy, left in flight."""
  return memory.put(weights, "device", likes=params)
