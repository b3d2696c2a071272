"""The stage functions :func:`jax_dos.nnx_stages` builds from a Flax NNX model, and the parameter paths they read.

A stage function is a frozen dataclass, equal (and of equal hash) where its
fields are, so that stages of equal models and functions share one compiled
program: :class:`EndStage` (the embedding's or the head's: the model rebuilt
from the stage's groups, the blocks shapes only) and :class:`LayerStage` (one
layer's module rebuilt from its group). Each is called as a
:class:`jax_dos.Stage`'s function, ``fn(params, x, batch, inputs)``, its RNG
keys and counters in ``inputs`` (``jax_dos.staged.stage_rng``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np

from jax_dos.staged import stage_rng

Path = tuple[Any, ...]


def nnx_module() -> Any:
  """``flax.nnx``, imported on first use: importing jax_dos does not import flax."""
  from flax import nnx

  return nnx


def abstract(tree: Any) -> Any:
  """``tree`` with each leaf its shape and dtype only (``jax.ShapeDtypeStruct``)."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def flatten(tree: dict, prefix: Path = ()) -> list[tuple[Path, Any]]:
  """``(path, leaf)`` of a nested dict, in ``jax.tree``'s order (sorted keys)."""
  if not isinstance(tree, dict):
    return [(prefix, tree)]
  return [item for key in sorted(tree) for item in flatten(tree[key], (*prefix, key))]


def nest(items: Sequence[tuple[Path, Any]]) -> dict:
  """The nested dict of ``(path, leaf)`` items (the inverse of :func:`flatten`)."""
  out: dict = {}
  for path, leaf in items:
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


def at(tree: dict, path: Path) -> Any:
  return functools.reduce(lambda node, key: node[key], path, tree)


def used_inputs(closed: Any, count: int) -> list[int]:
  """The indices among a jaxpr's first ``count`` inputs that its outputs depend on (equations walked backward)."""
  literal = jax.extend.core.Literal
  jaxpr = closed.jaxpr
  live = {v for v in jaxpr.outvars if not isinstance(v, literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, literal))
  return [i for i, v in enumerate(jaxpr.invars[:count]) if v in live]


class ByValue:
  """Equal, and of equal hash, where the fields are: stages of equal models and functions share compiled programs.

  ``jax.jit`` hashes a static argument (the stage function) at every call, so the hash is computed once.
  """

  def _key(self) -> tuple:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]

  def __eq__(self, other: object) -> bool:
    return self is other or (type(other) is type(self) and self._key() == other._key())  # type: ignore[attr-defined]

  def __hash__(self) -> int:
    cached = self.__dict__.get("_hash")
    if cached is None:
      cached = self.__dict__["_hash"] = hash((type(self), self._key()))
    return cached


class StageFunction(ByValue):
  """A stage function: ``run(params, x, batch, keys, counters, index) -> (out, counters after)`` with the RNG
  streams' keys and counters it reads (``keys``, ``counts``: their paths), called with ``Stage.inputs``."""

  def __call__(self, params: tuple, x: Any, batch: Any, inputs: Any = None) -> Any:
    return self.run(params, x, batch, *stage_rng.unpack(inputs))[0]  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, eq=False)
class EndStage(StageFunction):
  """The embedding's or the head's stage: the model rebuilt from the stage's groups, the blocks shapes only.

  ``layout`` is every parameter's and RNG key's and counter's ``(path,
  shape)`` in the model's layout, ``paths`` the paths of each group of the
  stage (in the stage's order), ``keys`` and ``counts`` those of the RNG
  streams it reads, ``absent`` the others' (``stage_rng.stand_in``; the rest
  of the blocks stays shapes).
  """

  graphdef: Any
  layout: tuple[tuple[Path, jax.ShapeDtypeStruct], ...]
  paths: tuple[tuple[Path, ...], ...]
  fn: Callable
  head: bool
  keys: tuple[Path, ...] = ()
  counts: tuple[Path, ...] = ()
  absent: tuple[tuple[Path, jax.ShapeDtypeStruct], ...] = ()
  called: Any = None

  def run(self, params: tuple, x: Any, batch: Any, keys: tuple, counts: tuple, index: Any) -> tuple[Any, tuple]:
    values = dict(self.layout)
    for paths, group in zip(self.paths, params):
      values.update((p, at(group, p)) for p in paths)
    values.update([*zip(self.keys, keys), *zip(self.counts, counts)])
    values.update((p, stage_rng.stand_in(s)) for p, s in self.absent)
    items, called = stage_rng.split_called(list(values.items()))
    model, rngs = nnx_module().merge(self.graphdef, nest(items)), called_streams(self.called, called)
    given = {} if rngs is None else {"rngs": rngs}
    out = self.fn(model, x, batch, **given) if self.head else self.fn(model, batch, **given)
    return out, stage_rng.counters(model, self.counts, rngs)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerStage(StageFunction):
  """One layer's stage: ``block(layer, x, batch)`` (with ``index``: ``block(layer, x, batch, index)``), the layer's
  module rebuilt from its group, the RNG keys and counters it reads (``keys``, ``counts``), stand-ins for those it
  does not (``absent``, ``stage_rng.stand_in``)."""

  graphdef: Any
  block: Callable | None
  keys: tuple[Path, ...] = ()
  counts: tuple[Path, ...] = ()
  absent: tuple[tuple[Path, jax.ShapeDtypeStruct], ...] = ()
  index: bool = False
  called: Any = None

  def run(self, params: tuple, x: Any, batch: Any, keys: tuple, counts: tuple, index: Any) -> tuple[Any, tuple]:
    (group,) = params
    absent = [(p, stage_rng.stand_in(s)) for p, s in self.absent]
    items, called = stage_rng.split_called([*zip(self.keys, keys), *zip(self.counts, counts), *absent])
    layer, rngs = (
      nnx_module().merge(self.graphdef, nest([*flatten(group), *items])),
      called_streams(self.called, called),
    )
    given = {} if rngs is None else {"rngs": rngs}
    if self.block is None:
      out = layer(x, **given)
    else:
      out = self.block(layer, x, batch, index, **given) if self.index else self.block(layer, x, batch, **given)
    return out, stage_rng.counters(layer, self.counts, rngs)


def called_streams(graphdef: Any, items: list[tuple[Path, Any]]) -> Any:
  """The streams given at call time (``nnx_stages(rngs=)``) rebuilt from their keys and counters; ``None`` where
  none were given."""
  return None if graphdef is None else nnx_module().merge(graphdef, nest(items))
