"""The stream mechanic: a subgroup's state copied in from pinned host memory, stepped on the accelerator, copied back.

One implementation for the eager engine (``Engine._stream``) and the overlapped step's stream path
(``overlap.stream_path.StreamPath``):

* :func:`copy_in`: the state ``[masters, mus, nus]`` on its way into accelerator memory (one batched copy);
* :func:`step`: AdamW on the accelerator (``device_steps.update_on_device``, the state donated), and the new state on
  its way back to pinned host memory, listed in a :class:`CopiesBack`;
* :class:`CopiesBack`: the copies back in flight, oldest first. A streamed subgroup holds a slot of accelerator
  memory from its copy in until its copy back has landed, so each caller keeps at most ``plan.stream_slots`` of them
  (with its copies in) and waits for the oldest to land before it takes another.

Where the two callers differ, the caller decides:

* the engine copies a subgroup in just before its update and frees its old host state at once (the copy in is
  ordered before the deletion), and never waits for its copies back: XLA's new buffers track their own copies;
* the stream path copies the next subgroups in ahead of their gradients (``StreamPath.prefetch``), waits for a copy
  in to land before it dispatches the update (a program whose input is in flight would hold the compute queue),
  keeps a speculated subgroup's old state until the clip decision, and with a
  :class:`~jax_dos.memory.pinned_arena.PinnedArena` copies back into buffers it owns through a
  :class:`~jax_dos.memory.copy_out.CopyOut` (XLA writes only buffers of its own): a subgroup stepped with the true scale
  into its own buffers, a fired clip's host share into the host path's spares.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import jax

from jax_dos import trace
from jax_dos.hand_off import receive
from jax_dos.memory import kinds as memory
from jax_dos.memory import pinned_arena
from jax_dos.memory.copy_out import CopyOut
from jax_dos.memory.pinned_arena import PinnedArena
from jax_dos.optimizer import device_steps


def copy_in(state: list[list[jax.Array]]) -> list[list[jax.Array]]:
  """``state`` (``[masters, mus, nus]`` of a subgroup, in pinned host memory) on its way to accelerator memory."""
  return memory.put_groups(state, "device")


class CopiesBack:
  """Streamed subgroups' new state on its way back to pinned host memory, oldest first (the module docstring).

  Each entry is the list of XLA's new host buffers (which track their own copy), or with an arena the future of the
  :class:`~jax_dos.memory.copy_out.CopyOut` writing the arena's buffers. A copy back's buffers may be deleted while
  still listed, by the thread that owns them (the stream path: a redo deletes a wasted speculation's copies, a later
  step the old state that was an earlier step's copy back); such an entry counts as landed.
  """

  def __init__(self, arena: PinnedArena | None = None, copier: CopyOut | None = None):
    self.arena, self._copier = arena, copier
    self._entries: deque = deque()

  def __len__(self) -> int:
    return len(self._entries)

  def __iter__(self):
    return iter(self._entries)

  def add(
    self, outs: list[list[jax.Array]], into: list[list[jax.Array]] | None = None
  ) -> tuple[list[list[jax.Array]] | None, Future | None]:
    """``outs`` (new state on the accelerator) on its way to host memory, listed: ``(buffers, None)``, XLA's new
    buffers (which track their own copy), without an arena; ``(None, landed)`` with one: the copy into ``into`` (or
    new arena buffers), whose future hands them back (:func:`landed`). The caller keeps no reference to ``into``:
    the copy worker holds them until they have landed."""
    if self.arena is None:
      back = memory.put_groups(outs, "pinned_host")
      self._entries.append(back)
      return back, None
    into = into or [[self.arena.array_like(a) for a in group] for group in outs]
    flat = [a for group in outs for a in group]
    landed = self._copier.submit(flat, [a for group in into for a in group], free_sources=True)
    self._entries.append(landed)
    return None, landed

  def oldest_landed(self) -> bool:
    """Whether the oldest copy back has landed (never waits)."""
    back = self._entries[0]
    if isinstance(back, Future):
      return back.done()
    return all(a.is_deleted() or a.is_ready() for a in jax.tree.leaves(back))

  def wait_oldest(self) -> None:
    """Waits until the oldest copy back has landed and unlists it: its slot is free."""
    back = self._entries.popleft()
    with trace.span("stream.wait_slot"):
      if isinstance(back, Future):
        back.result()
        return
      jax.block_until_ready([a for a in jax.tree.leaves(back) if not a.is_deleted()])

  def wait_all(self) -> None:
    """Waits until every copy back has landed, and lists none."""
    while self._entries:
      self.wait_oldest()


def landed(future: Future) -> list[list[jax.Array]]:
  """The new state ``[masters, mus, nus]`` a copy back wrote into arena buffers (:meth:`CopiesBack.add`), taken from
  its future's ``HandOff`` once it has landed (waits for it): the caller is their holder from here on."""
  flat = receive(future, None, "a copy back's buffers")
  n = len(flat) // 3
  return [flat[k * n : (k + 1) * n] for k in range(3)]


def step(
  grads: list[jax.Array], state: list[list[jax.Array]], params: list[jax.Array], scalars: Any, hyper: Any,
  decay: tuple[bool, ...], copies: CopiesBack, into: list[list[jax.Array]] | None = None, new_params: bool = True,
) -> tuple[list[jax.Array], list[list[jax.Array]], Future | None]:  # fmt: skip
  """One streamed subgroup's AdamW step from its state on the accelerator (``state``, donated; landed, or the update
  waits for it on the compute queue), its new state sent back to host memory and listed in ``copies``.

  Returns ``(outs, back, landed)``: the new parameters (``new_params``; the old ones donated) or the updates, and as
  :meth:`CopiesBack.add`: XLA's new host buffers, or with an arena the future of the copy into ``into`` (or new
  buffers), which hands them back (:func:`landed`).
  """
  outs = device_steps.update_on_device(grads, *state, params, scalars, hyper, decay, new_params)
  back, landed = copies.add(list(outs[1:]), into)
  return list(outs[0]), back, landed


def free(arena: PinnedArena | None, groups: list[list[jax.Array]]) -> None:
  """Frees host buffers whose copies are done (``pinned_arena.release``: back to ``arena``, or to XLA's pool)."""
  for a in (a for group in groups for a in group):
    pinned_arena.release(arena, a)
