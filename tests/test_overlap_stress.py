"""The overlapped step under random delays at every hand-off between its threads: the same numbers as optax.

A test-only hook (``jax_dos.job_thread.delay_hand_offs``) sleeps a random
0-2 ms at a random share of the hand-offs (a job queued and taken, a result
handed back through a future, a wait woken, a copy begun), so that the
threads' work comes in orders a quiet machine rarely shows. Each case runs
many steps over the placements, two micro-batches and run-ahead, with a clip
that fires on some steps and not others (speculated, redone, and the decision
followed), and its state must equal ``optax.chain(clip_by_global_norm, adamw)``
's at the end, with no crash and nothing left waiting.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import optax
import pytest
from overlap_model import (
  MIXED,
  STAGES,
  _subgroup_count,
  check_against_reference,
  make_batch,
  make_groups,
  overlapped_run,
)

import jax_dos
from jax_dos import job_thread

STEPS = 40  # a case; 4 cases: 160 steps, each with a few dozen hand-offs


class RandomDelays:
  """Sleeps ``0-max_s`` at a share ``p`` of the hand-offs; each thread draws from its own generator (none shared)."""

  def __init__(self, seed: int, p: float = 0.3, max_s: float = 0.002):
    self._seed, self._p, self._max_s = seed, p, max_s
    self._local = threading.local()
    self.count = 0  # hand-offs seen by the training thread only (written by it alone)
    self._main = threading.get_ident()

  def __call__(self) -> None:
    rng = getattr(self._local, "rng", None)
    if rng is None:
      rng = self._local.rng = np.random.default_rng([self._seed, threading.get_ident()])
    if threading.get_ident() == self._main:
      self.count += 1
    if rng.random() < self._p:
      time.sleep(rng.uniform(0, self._max_s))


def batches_whose_clip_fires_sometimes(rng: np.random.Generator, n: int) -> tuple[list, float]:
  """``n`` batches, every third with targets 30 times larger, and a clip norm between the two kinds' gradient norms
  at the start: it fires on the large ones (and, as the model trains, on others or none)."""
  batches = []
  for i in range(n):
    x, y = make_batch(rng)
    batches.append((x, y * 30 if i % 3 == 2 else y))
  groups = make_groups(np.random.default_rng(0))
  model = jax_dos.StagedModel(STAGES, len(groups))
  norms = [float(optax.global_norm(model.loss_and_grads(groups, b, 2)[1])) / 2 for b in batches[1:3]]  # the mean's
  return batches, float(np.sqrt(norms[0] * norms[1]))


@pytest.mark.parametrize(
  "plan, step_kw",
  [
    ("mixed", {}),
    ("mixed", {"run_ahead_stages": 2}),
    ("host", {"micro_batch_order": "batch"}),
    ("stream", {}),
    ("host", {"weights": "host", "run_ahead_stages": 2}),  # every weight in host memory, written by the kernel
  ],
)
def test_random_delays_at_every_hand_off_leave_optaxs_numbers(plan, step_kw):
  seed = int(np.random.default_rng().integers(2**31))
  rng = np.random.default_rng(seed)
  groups = make_groups(rng)
  spec = plan if plan != "mixed" else MIXED[: _subgroup_count(groups)]
  batches, clip = batches_whose_clip_fires_sometimes(rng, STEPS)
  delays = RandomDelays(seed)
  job_thread.delay_hand_offs(delays)
  try:
    step, _ = overlapped_run(groups, [], clip, 2, spec, **step_kw)
    norms = []
    for batch in batches:
      step(batch)
      norms.append(step.grad_norm)  # read after the run: no wait in the loop
    step.settle()
  finally:
    job_thread.delay_hand_offs(None)
  fired = [float(n) > clip for n in norms]
  assert any(fired) and not all(fired), f"seed {seed}: the clip fired in {sum(fired)} of {STEPS} steps"
  assert delays.count > STEPS, f"seed {seed}: the hook saw {delays.count} hand-offs"
  check_against_reference(step, groups, batches, clip, 2, tol=1e-4)
  step.close()
