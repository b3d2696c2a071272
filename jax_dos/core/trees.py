"""The parameter tree as the optimizer reads it: its leaves (each a floating-point array), Flax NNX variables in it,
and each leaf's weight-decay flag.

Shared by the optimizer (``interleaved``), its optax face (``transform``) and the overlapped step; it imports no
other module of ``jax_dos``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def leaves_with_paths(tree: Any, what: str) -> tuple[list[Any], Any]:
  """``tree``'s leaves and treedef, every leaf a floating-point array (a ``TypeError`` naming the first that is not).

  The paths are found only for that message: flattening an NNX state with its paths and typing each leaf cost tens
  of milliseconds a step at 6.7B.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if all(_floating(getattr(leaf, "dtype", None)) for leaf in leaves):
    return leaves, treedef
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"interleaved_adam: {what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; every leaf must be a"
        " floating-point array. Keep integer buffers out of the optimized tree (e.g. with optax.masked or a"
        " flax.nnx filter)."
      )
  return leaves, treedef


@functools.lru_cache(maxsize=64)
def _floating(dtype: Any) -> bool:
  """Whether ``dtype`` is a floating-point dtype (``None``: not an array's)."""
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def is_nnx_variable(x: Any) -> bool:
  """Whether ``x`` is a Flax NNX ``Variable`` (``nnx.Param`` and the like), without importing flax.

  A tree can hold NNX variables only once ``flax.nnx`` is imported, so this looks in ``sys.modules`` only.
  """
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None)
  return variable is not None and isinstance(x, variable)


def tree_without_variables(tree: Any, values: Sequence[Any]) -> Any:
  """``values``, one per leaf of ``tree``, in ``tree``'s structure with every NNX ``Variable`` dropped.

  Where ``tree`` holds ``nnx.Param(x)``, the result holds ``x``'s value itself (not a ``Param`` of it): what
  ``nnx.jit`` (and ``jax.jit``, as a prefix) takes as shardings of such a tree. A ``Variable`` over more than one
  array keeps its wrapper. Trees without variables come back as ``jax.tree.unflatten`` would make them.
  """
  items, treedef = jax.tree.flatten(tree, is_leaf=is_nnx_variable)
  rest = iter(values)
  out = []
  for item in items:
    sub = jax.tree.structure(item)
    if is_nnx_variable(item) and sub.num_leaves == 1:
      out.append(next(rest))
    else:
      out.append(jax.tree.unflatten(sub, [next(rest) for _ in range(sub.num_leaves)]))
  if next(rest, _END) is not _END:
    raise ValueError("tree_without_variables: more values than leaves.")
  return jax.tree.unflatten(treedef, out)


_END = object()


def decay_flags(mask, params, weight_decay: float) -> tuple[bool, ...]:
  n = len(jax.tree.leaves(params))
  if weight_decay == 0.0:
    return (False,) * n
  if mask is None:
    return (True,) * n
  mask_tree = mask(params) if callable(mask) else mask
  flags = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask_tree, params)
  out = tuple(jax.tree.leaves(flags))
  if len(out) != n:
    raise ValueError("mask must have the structure of params (or a prefix of it).")
  return out
