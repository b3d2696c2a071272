"""The overlapped step's clip decision and its speculation record: what a step's threads hand each other.

A step's gradient scale is known only after its last stage: ``scale =
clip_scale(|g| / k, c) / k`` for ``k`` micro-batches. The workers speculate
that it is ``1/k`` (the clip silent); the decider thread reads the true scale
once it exists and resolves :attr:`StepRecord.decision` with a
:class:`Decision`. Everything a step's threads pass each other goes through a
:class:`StepRecord`'s futures; each of its other fields is written by one
thread (named at the field), before the record is handed to the threads that
read it.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos import trace
from jax_dos.core.adam_math import clip_scale
from jax_dos.job_thread import hand_back

SPECULATION_MODES = ("auto", "silent", "always", "never")


def resolved_speculation(mode: str, predicted: dict[str, float]) -> str:
  """``mode``, with ``"auto"`` made ``"never"`` where a plan's predictions (``Plan.predicted``) say that waiting for
  every decision (its step after a fired clip, ``"step_clip_fired"``) is shorter than speculating with the clip
  silent (``"step_speculating"``), else ``"silent"``. Waiting steps every subgroup once, in the order the next
  forward pass needs it, both paths sharing the host's; a plan made for a fired clip may run that faster than the
  host path's hand-over order even where the clip is silent."""
  if mode not in SPECULATION_MODES:
    raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {mode!r}.")
  if mode != "auto":
    return mode
  waiting, speculating = predicted.get("step_clip_fired"), predicted.get("step_speculating")
  return "never" if waiting is not None and speculating is not None and waiting < speculating else "silent"


def _step_scale(squares: list[jax.Array], clip_norm: float | None, micro_batches: int) -> tuple[jax.Array, jax.Array]:
  """``(clip_scale(|g|, c) / k, |g|)`` from the groups' sums of squares, ``g = sum / k`` the mean gradient.

  With no clip the scale is ``1/k``.
  """
  mean = jnp.float32(1.0 / micro_batches)
  norm = jnp.sqrt(sum(squares, jnp.float32(0))) * mean
  return (mean if clip_norm is None else clip_scale(norm, clip_norm) * mean), norm


step_scale = jax.jit(_step_scale, static_argnums=(1, 2))


def start_copy_to_host(x: jax.Array) -> None:
  """Queues ``x``'s copy to the host now, so that a later read does not queue behind copies issued meanwhile."""
  copy = getattr(x, "copy_to_host_async", None)
  if copy is not None:
    copy()


@dataclasses.dataclass(frozen=True)
class Decision:
  """A step's clip decision: its step scalars with the true gradient scale, and whether that differs from the
  speculated one (the clip fired, or a non-finite norm)."""

  host: np.ndarray
  device: jax.Array
  fired: bool


class StepRecord:
  """One step's speculation and decision, and what its threads hand each other.

  ``spec_device``: the step scalars with the speculated scale ``1/k``.
  ``speculate`` (written by the training thread before the step's first job
  is queued): whether the workers speculate this step. ``decision``: resolved
  by the decider. ``host_share``: resolved by the host worker when the clip
  fired, with the inputs of the host subgroups the stream path steps;
  ``share_done``: resolved by the stream worker with their new state and their old one.
  ``host`` and ``stream``: each worker's own record of the step, made at its
  first job of the step and written by that worker only (``None`` before).
  """

  def __init__(self, spec_device: jax.Array):
    self.spec_device = spec_device
    start_copy_to_host(spec_device)
    self._spec_host: np.ndarray | None = None
    self._spec_lock = threading.Lock()
    self.speculate: bool | None = None
    self.decision: Future = Future()
    self.host_share: Future = Future()
    self.share_done: Future = Future()
    self.host: Any = None  # (host worker) overlap.host_path.HostStep
    self.stream: Any = None  # (stream worker) overlap.stream_path.StreamStep
    self.resident_grads: dict[int, jax.Array] = {}  # (training thread) leaf -> gradient, until the resident update

  def spec_host(self) -> np.ndarray:
    """The speculated scalars on the host (read once, by whichever thread asks first)."""
    with self._spec_lock:
      if self._spec_host is None:
        self._spec_host = np.asarray(self.spec_device)
      return self._spec_host

  def decided(self) -> Decision | None:
    """The decision if it is known, else ``None`` (never waits)."""
    return self.decision.result() if self.decision.done() else None

  def announce(self, true: jax.Array) -> Decision:
    """(decider thread) Reads the true scalars once the backward pass has ended and resolves :attr:`decision`."""
    with trace.span("decide.read"):
      host = np.asarray(true)
    decision = Decision(host, true, not host[3] == self.spec_host()[3])
    hand_back(self.decision, decision)
    return decision


def speculates(mode: str, previous: StepRecord | None) -> bool:
  """Whether a step's workers speculate that the clip stays silent, in speculation ``mode``.

  ``"silent"``: unless the previous step's clip fired. Its decision is known
  by the time this step's backward pass hands over (the decider reads it as
  that step's backward pass ends); where it is not yet, speculate.
  """
  if mode != "silent":
    return mode == "always"
  decision = None if previous is None else previous.decided()
  return decision is None or not decision.fired
