"""One holder a buffer, in code (``jax_dos.hand_off``): a hand-off is taken once, a place whose buffer was given away
cannot be read, and the overlapped step's parameters handed to its workers cannot be used by the training thread until
they come back."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
from overlap_model import MIXED, _subgroup_count, make_batch, make_groups, overlapped_run

from jax_dos.hand_off import Given, HandOff, HandOffError, Slots, receive, send
from jax_dos.job_thread import Failure


def test_a_hand_off_is_taken_once_by_one_thread():
  buffers = [np.arange(3)]
  given = HandOff(buffers, "subgroup 2's new parameters")
  taken: list = []
  errors: list = []

  def take():
    try:
      taken.append(given.take())
    except HandOffError as e:
      errors.append(e)

  threads = [threading.Thread(target=take) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(taken) == 1 and taken[0] is buffers and len(errors) == 3 and given.taken
  assert "subgroup 2's new parameters were taken already" in str(errors[0])


def test_buffers_sent_through_a_future_are_received_once():
  future: Future = Future()
  send(future, ["new"], "subgroup 0's new parameters")
  assert receive(future, Failure(), "new parameters") == ["new"]
  with pytest.raises(HandOffError, match="taken already"):
    receive(future, Failure(), "new parameters")


def test_a_place_whose_buffer_was_given_away_cannot_be_read_until_one_is_put_back():
  slots = Slots(["a", "b", "c"], "parameter leaf")
  assert slots.give([0, 2], "the host worker") == ["a", "c"]
  assert slots.held() == ["b"] and slots[1] == "b" and len(slots) == 3
  for use in (lambda: slots[0], lambda: slots[0:2], lambda: list(slots), lambda: slots.give([2], "the stream worker")):
    with pytest.raises(HandOffError, match="parameter leaf (0|2) was handed to the host worker"):
      use()
  slots[0], slots[2] = "A", "C"
  assert list(slots) == ["A", "b", "C"]
  assert "host worker" in repr(Given("parameter leaf 0", "the host worker"))


def test_the_training_thread_cannot_use_parameters_its_workers_hold():
  """After a step returns, the offloaded subgroups' parameters are the workers' until the next step (or ``params``)
  waits for the new ones: reading one in between raises, naming where it went; the step then runs on as before."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  step, _ = overlapped_run(groups, batches[:1], None, 1, MIXED[: _subgroup_count(groups)])
  placements = step.plan.leaf_placements()
  offloaded = [i for i, p in enumerate(placements) if p in ("host", "stream")]
  resident = [i for i, p in enumerate(placements) if p == "device"]
  assert offloaded and resident
  i = offloaded[0]
  with pytest.raises(HandOffError, match=f"parameter leaf {i} was handed to the {placements[i]} worker"):
    step._params[i]
  assert step._params[resident[0]] is not None  # the training thread's own
  float(step(batches[1]))  # the next step waits for them, and takes them back
  assert len(step.params) == len(groups)
  step.close()
