"""The checkpoint's canonical form: what a save writes of a state, and the template a restore reads it into.

This *canonical* form is plan-independent: every state leaf mirrors a parameter
leaf, in flatten order, whatever its placement or memory kind. So a checkpoint
restores into any plan, and into either optimizer: from an ``optax.adamw``
checkpoint (no ``master``) the master weights are the saved params read again
as float32 straight into the master's memory kind; into an ``optax.adamw``
state the master is dropped. ``ScaleByScheduleState`` counts are not stored:
they equal the Adam count. Other leaves of a chained state (``optax.chain``)
are stored in flatten order as ``extra``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jax_dos.checkpoint import moments as checkpoint_moments
from jax_dos.checkpoint.optax_state import AdamParts, split_adam
from jax_dos.checkpoint.template import TemplateMismatchError, stand_in_empties

FORMAT = "jax_dos.adam/1"


def to_disk(params: Any, opt_state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(trees, format)``: the trees a save writes (``params``, ``opt_state`` as ``{"count", "mu", "nu"[, "extra"]}``
  and, for a jax_dos state, ``master``; zero-size leaves stood in for) and the format record written beside them."""
  parts = split_adam(opt_state)
  canon = {"count": parts.count, "mu": parts.mu, "nu": parts.nu}
  if parts.extra:
    canon["extra"] = {str(i): x for i, x in enumerate(parts.extra)}
  trees = {"params": params, "opt_state": canon}
  if parts.master is not None:
    trees["master"] = parts.master
  fmt = {
    "format": FORMAT,
    "source": parts.kind,
    "has_master": parts.master is not None,
    "num_extra": len(parts.extra),
    "moments": checkpoint_moments.record(parts.mu),
  }
  return stand_in_empties(trees), fmt


@dataclasses.dataclass(frozen=True)
class DiskTemplate:
  """What a restore of step's canonical state reads into: the template's Adam ``parts``, the ``canon`` tree as on
  disk (its moments in the saved format ``source``; where that is not ``target``, the template's, ``moments`` are
  the two moment trees' stored shapes and dtypes, read apart and converted: ``moments.convert_leaf``), and the
  parameters' ``shapes``."""

  parts: AdamParts
  canon: dict[str, Any]
  moments: tuple[Any, Any]
  source: Any
  target: Any
  shapes: list[tuple[int, ...]]


def from_disk_template(step: int, fmt: dict[str, Any], params_t: Any, opt_t: Any) -> DiskTemplate:
  """The canonical template of ``opt_t`` (a state template for ``params_t``) for a checkpoint of format record
  ``fmt``; a :class:`TemplateMismatchError` where their chained optimizers differ."""
  parts = split_adam(opt_t)
  if fmt["num_extra"] != len(parts.extra):
    raise TemplateMismatchError(
      f"checkpoint step {step} has {fmt['num_extra']} optimizer-state leaves besides Adam's, the template has"
      f" {len(parts.extra)}; restore into an optimizer built like the one that was saved (same optax.chain)."
    )
  source, target = checkpoint_moments.saved(fmt), checkpoint_moments.tree_format(parts.mu)
  shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params_t)]
  moments_t = (parts.mu, parts.nu)
  if source != target:
    moments_t = tuple(checkpoint_moments.disk_template(t, shapes, *source) for t in moments_t)
  canon_t = {"count": parts.count, "mu": moments_t[0], "nu": moments_t[1]}
  if parts.extra:
    canon_t["extra"] = {str(i): x for i, x in enumerate(parts.extra)}
  return DiskTemplate(parts, canon_t, moments_t, source, target, shapes)
