"""train/step_log.py: the tokens/s windows."""

from __future__ import annotations

import pytest

from train import step_log


def test_a_window_of_tokens_per_s_starts_at_a_steps_return_not_at_a_settled_point():
  """After the settled first step (and after an evaluation or a save) the next window starts at the next step's
  return, so that every window starts and ends with a step's work in flight (``step_log.Rate``)."""
  rate = step_log.Rate(tokens_per_step=100, flops_per_token=2.0, peak_flops=1000.0)
  rate.returned(1, 5.0)  # before start: nothing changes
  rate.start(1)  # settled after step 1
  rate.returned(2, 10.0)  # the window starts here, at step 2's return
  rate.returned(3, 11.0)
  rate.mark(5, 13.0)
  assert rate.tokens_per_s == pytest.approx(3 * 100 / 3.0) and rate.mfu == pytest.approx(2.0 * 100 / 1000)
  rate.restart()  # an evaluation: drained
  rate.returned(7, 20.0)
  rate.mark(10, 26.0)
  assert rate.tokens_per_s == pytest.approx(3 * 100 / 6.0)
  rate.returned(11, 27.0)  # no settled point since: marks follow one another
  rate.mark(12, 28.0)
  assert rate.tokens_per_s == pytest.approx(2 * 100 / 2.0)
