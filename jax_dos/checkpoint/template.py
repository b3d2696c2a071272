"""How a checkpoint's trees meet the caller's template: the tree check, zero-size leaves, Orbax's restore arguments.

A restore template's array leaves must match the checkpoint's paths and
shapes (:func:`check_tree`, else :class:`TemplateMismatchError` naming the
differences). Orbax refuses zero-size arrays, so each is saved as a
one-element stand-in (:func:`stand_in_empties`) and restored to the
template's shape, dtype and placement (:func:`fill_empties`).
:func:`restore_item` restores a tree in the template's shardings and memory
kinds (leaves that are :data:`PLACEHOLDER` unread), :func:`read_as_numpy`
some of its leaves as numpy arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class _Orbax:
  """``orbax.checkpoint``, imported at first use: importing it adds about 0.2 s to every ``import jax_dos``."""

  def __getattr__(self, name: str) -> Any:
    import orbax.checkpoint

    return getattr(orbax.checkpoint, name)


ocp = _Orbax()
PLACEHOLDER = ...  # Orbax's PLACEHOLDER (``orbax.checkpoint.PLACEHOLDER``): a leaf a restore leaves unread


def _key_str(key: tuple) -> str:
  return "/".join(str(k) for k in key) or "<root>"


def _array_keys(tree: Any) -> dict[tuple, tuple]:
  """Flat {path: shape} of the array leaves of a template or an Orbax metadata tree."""
  flat = ocp.tree.to_flat_dict(tree)
  return {k: tuple(v.shape) for k, v in flat.items() if hasattr(v, "shape") and hasattr(v, "dtype")}


def check_tree(what: str, step: int, template: Any, on_disk: Any) -> None:
  want = _array_keys(ocp.tree.serialize_tree(template, keep_empty_nodes=True))
  have = _array_keys(on_disk)
  missing = sorted(_key_str(k) for k in want.keys() - have.keys())
  unexpected = sorted(_key_str(k) for k in have.keys() - want.keys())
  shapes = sorted(
    f"{_key_str(k)}: checkpoint {have[k]}, template {want[k]}" for k in want.keys() & have.keys() if want[k] != have[k]
  )
  if missing or unexpected or shapes:
    lines = [f"checkpoint step {step}: the {what} do not match the template you passed to restore."]
    if missing:
      lines.append(f"  in the template but not in the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if unexpected:
      lines.append(
        f"  in the checkpoint but not in the template: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
      )
    if shapes:
      lines.append(f"  shape mismatches: {shapes[:10]}{' ...' if len(shapes) > 10 else ''}")
    lines.append("Build the template from the same model configuration the checkpoint was saved with.")
    raise TemplateMismatchError("\n".join(lines))


class TemplateMismatchError(ValueError):
  """The restore template's tree does not match the checkpoint's."""


def is_empty(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype") and 0 in tuple(x.shape)


# Orbax refuses zero-size arrays. Each is saved as a one-element stand-in; its real shape comes from the template.
def stand_in_empties(tree: Any) -> Any:
  return jax.tree.map(lambda x: np.zeros((1,), x.dtype) if is_empty(x) else x, tree)


def disk_template(template: Any) -> Any:
  """The template as it is on disk: zero-size leaves as their one-element stand-ins."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,), x.dtype) if is_empty(x) else x, template)


def restore_item(template: Any) -> ocp.args.PyTreeRestore:
  """Restores ``template``'s tree in its shardings and memory kinds (stand-ins of empty leaves as numpy); leaves
  that are ``PLACEHOLDER`` are not read (they come back as ``PLACEHOLDER``)."""
  args = ocp.checkpoint_utils.construct_restore_args(template)

  def arg(t, a):
    return ocp.RestoreArgs(restore_type=np.ndarray) if is_empty(t) else ocp.RestoreArgs() if t is PLACEHOLDER else a

  return ocp.args.PyTreeRestore(disk_template(template), restore_args=jax.tree.map(arg, template, args))


def read_as_numpy(template: Any, wanted: set[int]) -> ocp.args.PyTreeRestore:
  """Restores the leaves ``wanted`` (indices in ``template``'s flatten order; their stored shapes) of a tree as numpy
  arrays, whole in every process; the others are not read (they come back as ``PLACEHOLDER``)."""
  leaves, treedef = jax.tree.flatten(template)
  item = [x if i in wanted else PLACEHOLDER for i, x in enumerate(leaves)]
  args = [ocp.RestoreArgs(restore_type=np.ndarray) if i in wanted else ocp.RestoreArgs() for i in range(len(leaves))]
  return ocp.args.PyTreeRestore(jax.tree.unflatten(treedef, item), restore_args=jax.tree.unflatten(treedef, args))


def fill_empties(restored: Any, template: Any) -> Any:
  """Replaces the stand-ins with zero-size arrays shaped, typed and placed like the template's."""

  def fill(x, t):
    if not is_empty(t):
      return x
    empty = np.zeros(t.shape, t.dtype)
    sharding = getattr(t, "sharding", None)
    return jax.device_put(empty, sharding) if sharding is not None else empty

  return jax.tree.map(fill, restored, template)
