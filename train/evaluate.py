"""The training script's validation: the model's loss on held-out batches, jitted once per model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from models import lm

# Jitted at module level (the model's graphdef is a static, hashable argument) so that runs of the same model in one
# process share compiled code.
eval_step = jax.jit(lm.loss, static_argnums=0)


def validation_loss(graphdef: Any, params: Any, batches: Sequence[Any]) -> float:
  """The mean of the model's loss over ``batches`` (each an ``(inputs, targets)`` pair of token arrays)."""
  losses = jax.device_get([eval_step(graphdef, params, b) for b in batches])  # one wait, not one per batch
  return float(np.mean(losses, dtype=np.float64))
