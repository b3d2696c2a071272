"""``--profile FIRST:STOP``: what the accelerator and the host's threads did in steps ``FIRST`` to ``STOP - 1``.

Two records, written to ``<out>/profile``:

- jax.profiler's trace (``plugins/profile/<time>/``, with a Perfetto trace): the accelerator's programs and
  operations, for TensorBoard's profile plugin, ui.perfetto.dev or ``bench/probes/trace_summary.py``;
- ``spans.json``: ``jax_dos.trace``'s spans of the same steps, what the step's own threads did on the host (the host
  kernel's calls, the sends, each wait and what it waited for) and when each stage program finished on the
  accelerator, in seconds from the first step's start, with their totals (``jax_dos.trace.totals``).

The step is settled at both ends, so that both hold those steps' work whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax

import jax_dos


class Profile:
  """``--profile FIRST:STOP`` (``steps``; ``None``: nothing recorded) of ``step`` (a train step with ``settle()``),
  into ``folder``; ``say`` takes the line that names what was written."""

  def __init__(self, steps: tuple[int, int] | None, folder: str, step: Any, say: Callable[[str], None]) -> None:
    self._steps, self._folder, self._step, self._say = steps, folder, step, say
    self._spans: contextlib.ExitStack | None = None
    self._recorded: list[jax_dos.trace.Span] = []
    self._t0 = 0.0

  def before(self, step_no: int) -> None:
    """Before step ``step_no``: starts both records at ``FIRST``."""
    if self._steps is not None and step_no == self._steps[0] and self._spans is None:
      self._step.settle()
      options = jax.profiler.ProfileOptions()
      options.python_tracer_level = 0  # the Python threads' every call would bloat the trace and slow the step
      jax.profiler.start_trace(self._folder, create_perfetto_trace=True, profiler_options=options)
      self._spans = contextlib.ExitStack()
      self._recorded = self._spans.enter_context(jax_dos.trace.recording())
      self._t0 = time.perf_counter()

  def after(self, step_no: int | None) -> None:
    """After step ``step_no`` (``None``: the run's end, which ends records still open)."""
    if self._spans is not None and (step_no is None or step_no == self._steps[1] - 1):
      self._step.settle()
      jax.profiler.stop_trace()
      self._spans.close()
      self._spans = None
      self._write_spans()
      first, last = self._steps[0], self._steps[1] - 1
      steps = f"step {first}" if first == last else f"steps {first}-{last}"
      self._say(f"wrote the profile of {steps} to {self._folder} (jax.profiler's trace; the host's spans: spans.json)")

  def _write_spans(self) -> None:
    spans = [dict(dataclasses.asdict(s), start=s.start - self._t0, end=s.end - self._t0) for s in self._recorded]
    out = {"steps": list(self._steps), "totals": jax_dos.trace.totals(self._recorded), "spans": spans}
    os.makedirs(self._folder, exist_ok=True)
    with open(os.path.join(self._folder, "spans.json"), "w") as f:
      json.dump(out, f)
