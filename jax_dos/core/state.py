"""The optimizer state of ``interleaved_adam``: a step count and three trees mirroring the parameters.

As optax's ``ScaleByAdamState``, plus the float32 master weights that
``optax.adamw`` keeps in the parameters themselves. Each leaf lives in the
memory kind its subgroup's placement asks for (``plan.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax


class InterleavedAdamState(NamedTuple):
  """State of ``jax_dos.interleaved_adam``: trees mirroring the parameters."""

  count: jax.Array  # int32 scalar: steps taken
  master: optax.Params  # fp32 master weights
  mu: optax.Updates  # first moment, fp32
  nu: optax.Updates  # second moment, fp32
