"""Reading one checkpoint step into the caller's templates: the params alone, or the params and the whole state.

Contract: the step is committed and already verified (the manager's job: nothing here checks a file or waits for a
save), and every process makes the same calls (each reads the shards it addresses).
The templates' trees are checked against the step's metadata first (:func:`template.check_tree`), so a mismatch raises
:class:`TemplateMismatchError` before any array is read.

Every array is placed directly in its memory kind: the restore arguments are built from the template's shardings
(memory kind included), so Orbax reads each shard from disk into a buffer of that sharding; ``pinned_host`` state
never passes through accelerator memory. Moments stored in another format are read apart and converted a group of
leaves at a time (``moments.py``); from an ``optax`` checkpoint the master weights are its params read again as float32
(``canonical.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_dos.checkpoint import canonical
from jax_dos.checkpoint import moments as checkpoint_moments
from jax_dos.checkpoint.template import PLACEHOLDER, check_tree, disk_template, fill_empties, ocp, restore_item


def _tree_of(metadata: Any) -> Any:
  return getattr(metadata, "tree", metadata)


def read_params(mgr: ocp.CheckpointManager, step: int, params: Any) -> tuple[Any, dict]:
  """``(params, meta)`` of ``step`` read through Orbax's manager ``mgr``, placed like the template ``params``."""
  metadata = mgr.item_metadata(step)
  check_tree("params", step, disk_template(params), _tree_of(metadata["params"]))
  items = ocp.args.Composite(params=restore_item(params), meta=ocp.args.JsonRestore())
  out = mgr.restore(step, args=items)
  return fill_empties(out["params"], params), out["meta"]


def read_master(mgr: ocp.CheckpointManager, step: int, params: Any) -> tuple[Any, dict] | None:
  """``(master, meta)`` of ``step``: its float32 master weights (a jax_dos state's), shaped and placed like the
  template ``params`` but in float32, or ``None`` where the step has none (an ``optax`` checkpoint's params are its
  weights)."""
  fmt = mgr.restore(step, args=ocp.args.Composite(format=ocp.args.JsonRestore()))["format"]
  if not fmt["has_master"]:
    return None
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params)
  check_tree("master weights", step, disk_template(template), _tree_of(mgr.item_metadata(step)["master"]))
  out = mgr.restore(step, args=ocp.args.Composite(master=restore_item(template), meta=ocp.args.JsonRestore()))
  return fill_empties(out["master"], template), out["meta"]


def read_step(mgr: ocp.CheckpointManager, step: int, params_t: Any, opt_t: Any) -> tuple[Any, Any, dict]:
  """``(params, opt_state, meta)`` of ``step`` read through Orbax's manager ``mgr``, shaped, sharded and placed like
  the templates ``params_t`` and ``opt_t`` (either optimizer's state, whichever the step holds)."""
  fmt = mgr.restore(step, args=ocp.args.Composite(format=ocp.args.JsonRestore()))["format"]
  t = canonical.from_disk_template(step, fmt, params_t, opt_t)
  parts, canon_t, source, target = t.parts, t.canon, t.source, t.target
  metadata = mgr.item_metadata(step)
  check_tree("params", step, disk_template(params_t), _tree_of(metadata["params"]))
  check_tree("optimizer state (count, mu, nu)", step, disk_template(canon_t), _tree_of(metadata["opt_state"]))

  converting = source != target  # the moments read apart, a group of leaves at a time (moments.read_converted)
  unread = lambda tree: jax.tree.map(lambda _: PLACEHOLDER, tree)  # noqa: E731
  read_t = {**canon_t, "mu": unread(canon_t["mu"]), "nu": unread(canon_t["nu"])} if converting else canon_t
  want_master = parts.kind == "interleaved"
  items = {
    "params": restore_item(params_t),
    "opt_state": restore_item(read_t),
    "meta": ocp.args.JsonRestore(),
  }
  if want_master and fmt["has_master"]:
    check_tree("master weights", step, disk_template(parts.master), _tree_of(metadata["master"]))
    items["master"] = restore_item(parts.master)
  out = mgr.restore(step, args=ocp.args.Composite(**items))
  master = fill_empties(out["master"], parts.master) if "master" in items else None
  if want_master and not fmt["has_master"]:
    # An optax checkpoint: master = float32(saved params), read straight into the master's memory kind.
    check_tree("params (as master weights)", step, disk_template(parts.master), _tree_of(metadata["params"]))
    master = mgr.restore(step, args=ocp.args.Composite(params=restore_item(parts.master)))["params"]
    master = fill_empties(master, parts.master)
  c = fill_empties(out["opt_state"], read_t)
  if converting:  # stored in another format: converted to the template's
    c["mu"], c["nu"] = checkpoint_moments.read_converted(mgr.restore, step, t)
    checkpoint_moments.say_converted(step, source, target)
  extra = [c["extra"][str(i)] for i in range(len(parts.extra))] if parts.extra else []
  params = fill_empties(out["params"], params_t)
  return params, parts.rebuild(c["count"], master, c["mu"], c["nu"], extra), out["meta"]
