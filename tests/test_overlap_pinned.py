"""The overlapped step's pinned host memory, measured while it runs, against ``OverlappedStep.host_bytes()``."""

from __future__ import annotations

import gc
import time

import jax
import numpy as np
import pytest
from overlap_model import (
  FIRES,
  NEVER,
  _subgroup_count,
  check_against_reference,
  make_batch,
  make_groups,
  overlapped_run,
)

import jax_dos
from jax_dos.memory import kinds as memory
from jax_dos.memory import pinned_pool
from jax_dos.overlap import stream_path
from jax_dos.overlap.host_path import HostPath


def _pinned_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and a.sharding.memory_kind == "pinned_host")


def _record_stream_puts(monkeypatch) -> list[int]:
  """A list that gets, at each put of the stream path into pinned memory, the live pinned bytes above those live now,
  the put's new arrays counted."""
  gc.collect()
  before, seen = _pinned_bytes(), []
  put_groups = memory.put_groups

  def counting_put_groups(groups_, kind):
    if kind == "pinned_host":
      seen.append(_pinned_bytes() - before + sum(x.nbytes for g in groups_ for x in g))
    return put_groups(groups_, kind)

  monkeypatch.setattr(stream_path.memory, "put_groups", counting_put_groups)
  return seen


def _within_host_bytes(step, seen: list[int]) -> None:
  """XLA's pool: the live pinned bytes at each put (``seen``); the arena: the most its arrays held at once. Each
  within ``host_bytes()``."""
  if step.arena is None:
    assert seen and max(seen) <= step.host_bytes(), (seen, step.host_bytes())
  else:
    assert not seen  # nothing of the step's state went to XLA's pool
    assert 0 < step.arena.peak_bytes <= step.host_bytes(), (step.arena.peak_bytes, step.host_bytes())


@pytest.mark.parametrize("pinned", ["arena", "pool"])
@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_a_stream_heavy_plans_pinned_arrays_stay_within_host_bytes(monkeypatch, clip_norm, pinned):
  """A plan of mostly streamed subgroups, speculating every step: at each copy back to pinned memory the step's live
  pinned arrays, the copy's new ones counted, stay within ``host_bytes()`` (the state and the new state of the
  streamed parameters speculated on): a subgroup stepped with the true scale while the speculation is full frees its
  old state before its new one comes (XLA's pool), or writes its new state into its old buffers (the arena). The
  numbers are optax's."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(4)]
  plan = ["device"] + ["stream"] * (_subgroup_count(groups) - 1)
  sizes = jax_dos.planning.plan.partition_groups(groups, 40)[1]
  budget = 12 * sum(sizes[1:]) + 12 * 2 * max(sizes)  # the state and speculation on two subgroups
  seen = _record_stream_puts(monkeypatch)
  step, _ = overlapped_run(groups, batches, clip_norm, 2, plan, speculation="always", stream_slots=3,
                           host_budget_bytes=budget, pinned_memory=pinned)  # fmt: skip
  step.settle()
  assert 0 < step.stream_speculation < sum(sizes[1:])
  assert (step.arena is None) == (pinned == "pool")
  _within_host_bytes(step, seen)
  check_against_reference(step, groups, batches, clip_norm, 2)
  step.close()


@pytest.mark.parametrize("pinned,init", [("arena", False), ("arena", True), ("pool", False)])
def test_a_fired_clips_shared_redo_stays_within_the_planned_host_bytes(monkeypatch, pinned, init):
  """A speculated step whose clip fires: when the stream path puts its share of the host subgroups' new state into
  pinned memory, the step's pinned arrays stay within ``host_bytes()`` (the state, one spare, the copies): the share's
  spare goes before its new state comes (XLA's pool) or takes it (the arena), never three copies of it at once."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  plan = ["device", "stream"] + ["host"] * (_subgroup_count(groups) - 2)
  seen = _record_stream_puts(monkeypatch)
  # init: tx.init's state in XLA's pool, which an arena step keeps where it is and writes in place
  step, _ = overlapped_run(groups, batches, FIRES, 2, plan, speculation="always", pinned_memory=pinned, init=init)
  step.settle()
  assert step.routes.redo_on_stream
  _within_host_bytes(step, seen)
  check_against_reference(step, groups, batches, FIRES, 2)
  step.close()


def test_the_stream_path_lists_no_array_it_handed_to_the_host_path():
  """A fired clip's share comes back from the stream path as host state, which the host worker may free at any time
  after (a spare in XLA's pool, at a later fired clip): the stream path lists none of it among its copies in flight,
  where its own thread would read it (CI saw a segfault there: one thread waiting on an array another deleted)."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  plan = ["device", "stream"] + ["host"] * (_subgroup_count(groups) - 2)
  step, _ = overlapped_run(groups, batches, FIRES, 2, plan, speculation="always", pinned_memory="pool")
  step.settle()
  assert step.routes.redo_on_stream
  host = step._workers.host_path
  held = {id(a) for d in (host.masters, host.mus, host.nus) for a in d.values()}
  held |= {id(a) for spare in host.spares.values() for a in spare}
  listed = {id(a) for back in step._workers.stream_path._in_flight for a in jax.tree.leaves(back)}
  assert held and not held & listed
  check_against_reference(step, groups, batches, FIRES, 2)
  step.close()


@pytest.mark.parametrize("measured_here,init", [(False, False), (True, False), (False, True)])
def test_auto_keeps_the_state_in_a_pool_already_grown(monkeypatch, measured_here, init):
  """``pinned_memory="auto"``: the arena, unless XLA's pool holds pinned memory for good already: this process
  measured the calibration on an accelerator, or the state given lives there (``tx.init``'s). The state then goes
  into that pool. The numbers are optax's either way."""
  from jax_dos.planning import calibration

  monkeypatch.setattr(calibration, "_measured_here", measured_here)
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  plan = ["device", "stream"] + ["host"] * (_subgroup_count(groups) - 2)
  step, _ = overlapped_run(groups, batches, FIRES, 2, plan, init=init)
  assert (step.arena is None) == (measured_here or init)
  if step.arena is not None:  # all of it in the arena: its bytes, the process's and (a GPU's) its memory's table
    table = int(pinned_pool.accelerator_pool_bytes() * pinned_pool.accelerator_table_fraction())  # no pool's regions
    assert step.resident_estimate() == step.host_bytes() + pinned_pool.PROCESS_BYTES + table
  check_against_reference(step, groups, batches, FIRES, 2)
  step.close()


@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_the_arena_holds_the_same_bytes_step_after_step(monkeypatch, clip_norm):
  """Every buffer a step takes from the arena goes back (gradients once read, a wasted speculation, an old state): a
  long run holds what its first steps held, and never more than the step's ``host_bytes``, also where the host worker
  lags after handing new weights back (a subgroup's gradients are freed before, not after: the training thread then
  hands over the next step's)."""
  final = HostPath._final
  monkeypatch.setattr(HostPath, "_final", staticmethod(lambda st, s: (final(st, s), time.sleep(0.02))))
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(6)]
  plan = ["device", "stream", "stream"] + ["host"] * (_subgroup_count(groups) - 3)
  step, _ = overlapped_run(groups, batches[:3], clip_norm, 2, plan, speculation="always", pinned_memory="arena")
  step.settle()
  held = step.arena.live_bytes
  for batch in batches[3:]:
    step(batch)
  step.settle()
  assert step.arena.live_bytes == held and step.arena.peak_bytes <= step.host_bytes()
  step.close()
