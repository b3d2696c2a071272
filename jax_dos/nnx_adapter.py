"""Stages from a Flax NNX model's own modules: what :class:`jax_dos.OverlappedStep` needs, and the way back.

:func:`nnx_stages` reads a model as ``loss = head(blocks(embed(batch)))``,
with the repeated blocks an ``nnx.List`` of modules or one module
whose parameters are a stack of layers along a leading axis (made with
``nnx.vmap``/``nnx.scan``), and returns an :class:`NNXStages`::

    staged = jax_dos.nnx_stages(model, batch, embed=lambda m, b: m.embed(b[0]), blocks="blocks",
                                head=lambda m, x, b: cross_entropy(m.logits(x), b[1]))
    step = jax_dos.OverlappedStep(tx, staged.stages, staged.give(model), clip_norm=1.0, micro_batches=2)
    for batch in data:
        step(batch)
    staged.update(model, step.params)       # the trained parameters, back in the model

The parameter groups, in stage order:

* group ``0``: the parameters ``embed`` reads (the first stage);
* groups ``1 .. L``: layer ``i - 1`` of the blocks, one stage each, all
  layers of one structure sharing one stage function (one compiled program);
  a stack's layer ``i`` is its parameters' slice ``[i]``;
* group ``L + 1``: the parameters ``head`` reads that ``embed`` does not,
  and any parameter nothing reads (its gradient is zero, as ``jax.grad``'s).
  The head's stage also takes group ``0`` where it reads any of it: tied
  weights (a head multiplying by the token embedding) need nothing more.

Which parameters ``embed`` and ``head`` read is found by tracing them once on
``batch``'s shapes (``jax.make_jaxpr``), the blocks' parameters standing in as
shapes only. Each stage calls the model's own modules: ``embed(model, batch)``
and ``head(model, x, batch)`` get the model rebuilt from the stage's groups
(``nnx.merge``), each layer's stage ``block(layer, x, batch)`` (default
``layer(x)``) the layer's module.

The stages are pure functions of the parameters: a model holding other state
(``nnx.Dropout``'s or a module's own RNG streams, batch statistics, caches,
plain arrays) is refused, with the paths that hold it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from jax_dos.hand_off import Given
from jax_dos.stages import Stage

Path = tuple[Any, ...]


def _nnx():
  """``flax.nnx``, imported on first use: importing jax_dos does not import flax."""
  from flax import nnx

  return nnx


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _flatten(tree: dict, prefix: Path = ()) -> list[tuple[Path, Any]]:
  """``(path, leaf)`` of a nested dict, in ``jax.tree``'s order (sorted keys)."""
  if not isinstance(tree, dict):
    return [(prefix, tree)]
  return [item for key in sorted(tree) for item in _flatten(tree[key], (*prefix, key))]


def _nest(items: Sequence[tuple[Path, Any]]) -> dict:
  """The nested dict of ``(path, leaf)`` items (the inverse of :func:`_flatten`)."""
  out: dict = {}
  for path, leaf in items:
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


def _at(tree: dict, path: Path) -> Any:
  return functools.reduce(lambda node, key: node[key], path, tree)


def _used_inputs(closed: Any, count: int) -> list[int]:
  """The indices among a jaxpr's first ``count`` inputs that its outputs depend on (equations walked backward)."""
  literal = jax.extend.core.Literal
  jaxpr = closed.jaxpr
  live = {v for v in jaxpr.outvars if not isinstance(v, literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, literal))
  return [i for i, v in enumerate(jaxpr.invars[:count]) if v in live]


class _ByValue:
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


@dataclasses.dataclass(frozen=True, eq=False)
class _EndStage(_ByValue):
  """The embedding's or the head's stage: the model rebuilt from the stage's groups, the blocks shapes only.

  ``layout`` is every parameter's ``(path, shape)`` in the model's layout,
  ``paths`` the paths of each group of the stage (in the stage's order).
  """

  graphdef: Any
  layout: tuple[tuple[Path, jax.ShapeDtypeStruct], ...]
  paths: tuple[tuple[Path, ...], ...]
  fn: Callable
  head: bool

  def model(self, groups: Sequence[dict]) -> Any:
    values = dict(self.layout)
    for paths, group in zip(self.paths, groups):
      values.update((p, _at(group, p)) for p in paths)
    return _nnx().merge(self.graphdef, _nest(list(values.items())))

  def __call__(self, params: tuple, x: Any, batch: Any) -> Any:
    model = self.model(params)
    return self.fn(model, x, batch) if self.head else self.fn(model, batch)


@dataclasses.dataclass(frozen=True, eq=False)
class _LayerStage(_ByValue):
  """One layer's stage: ``block(layer, x, batch)``, the layer's module rebuilt from its group."""

  graphdef: Any
  block: Callable | None

  def __call__(self, params: tuple, x: Any, batch: Any) -> Any:
    (group,) = params
    layer = _nnx().merge(self.graphdef, group)
    return layer(x) if self.block is None else self.block(layer, x, batch)


class NNXStages:
  """A Flax NNX model as ``jax_dos.Stage`` s over parameter groups (made by :func:`nnx_stages`).

  Attributes:
    stages: the stages, in forward order: the embedding, one per layer, the
      head (``jax_dos.OverlappedStep``'s ``stages``).
    num_groups: how many parameter groups the stages use.
    num_layers: the blocks' layers.
    stacked: whether the blocks are one stacked module (their groups slices).

  :meth:`split` makes the groups from the model or any tree in the layout of
  its ``nnx.Param`` state (the optimizer state's ``master``, ``mu``, ``nu``
  too); :meth:`merge` is its inverse; :meth:`update` writes groups into the
  model, as ``nnx.update``.
  """

  def __init__(self, stages, layout, group_paths, blocks_path, layer_keys, stacked):
    self.stages: tuple[Stage, ...] = tuple(stages)
    self._layout: tuple[tuple[Path, Any], ...] = layout
    self._group_paths: tuple[tuple[Path, ...], ...] = group_paths  # embed's and head's groups
    self._blocks_path: Path = blocks_path
    self._layer_keys: tuple = layer_keys  # the blocks' keys (nnx.List: 0 .. L-1); a stack: ()
    self.stacked: bool = stacked
    self.num_layers: int = len(stages) - 2
    self.num_groups: int = self.num_layers + len(group_paths)

  def split(self, tree: Any) -> list[Any]:
    """The groups of ``tree``: the model itself, its ``nnx.Param`` state, or a tree in that state's layout.

    ``nnx.State`` s become plain arrays (``nnx.to_pure_dict``). A group holds
    the tree's own arrays, except a stack's layers, which are slices (copies).
    """
    nnx = _nnx()
    if isinstance(tree, nnx.Module):
      tree = nnx.state(tree, nnx.Param)
    if isinstance(tree, nnx.State):
      tree = nnx.to_pure_dict(tree)
    try:
      ends = [_nest([(p, _at(tree, p)) for p in paths]) for paths in self._group_paths]
      blocks = _at(tree, self._blocks_path)
      if self.stacked:
        layers = [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(self.num_layers)]
      else:
        layers = [blocks[k] for k in self._layer_keys]
    except (KeyError, TypeError, IndexError) as e:
      raise ValueError(f"NNXStages.split: the tree is not in the model's nnx.Param layout (at {e!r}).") from None
    return [ends[0], *layers, *ends[1:]]

  def give(self, model: Any) -> list[Any]:
    """The groups of ``model``'s parameters (:meth:`split`), handed to the step that consumes them
    (``OverlappedStep(tx, staged.stages, staged.give(model), ...)``). In each parameter's place the model keeps a
    ``hand_off.Given``: calling the model, or any use of a parameter, raises ``HandOffError`` naming
    :meth:`update`, until :meth:`update` writes parameters back (not ``Array has been deleted`` once the step has
    donated them)."""
    nnx = _nnx()
    if not isinstance(model, nnx.Module):
      raise TypeError(f"NNXStages.give takes the flax.nnx.Module itself, got {type(model).__name__}.")
    groups = self.split(model)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, variable in flat:
      variable.value = Given(
        f"the model's parameter {'/'.join(map(str, path))}", "the overlapped step (NNXStages.give)",
        "put the trained parameters back with staged.update(model, step.params) before using the model",
      )  # fmt: skip
    nnx.update(model, nnx.from_flat_state(flat))
    return groups

  def merge(self, groups: Sequence[Any]) -> dict:
    """The tree in the model's ``nnx.Param`` layout (a pure dict, as ``nnx.to_pure_dict``) of ``groups``.

    A stack's layers are stacked again along the leading axis (a copy).
    """
    groups = list(groups)
    if len(groups) != self.num_groups:
      raise ValueError(f"NNXStages.merge: expected {self.num_groups} groups (the stages'), got {len(groups)}.")
    layers = groups[1 : 1 + self.num_layers]
    ends = [groups[0], *groups[1 + self.num_layers :]]
    items = [(p, _at(g, p)) for paths, g in zip(self._group_paths, ends) for p in paths]
    if self.stacked:
      blocks = jax.tree.map(_stack, *layers)
    else:
      blocks = dict(zip(self._layer_keys, layers))
    return _nest([*items, (self._blocks_path, blocks)])

  def update(self, model: Any, groups: Sequence[Any]) -> None:
    """Writes ``groups`` (``OverlappedStep.params``) into ``model``'s parameters, in place (``nnx.update``)."""
    _nnx().update(model, self.merge(groups))


def _stack(*layers: Any) -> Any:
  """The layers' leaves stacked along a new leading axis: arrays (a copy), or ``jax.ShapeDtypeStruct`` s (a restore
  template, ``jax_dos.abstract_state``), each layer's sharding with the stack's axis unsharded before its own."""
  first = layers[0]
  if not isinstance(first, jax.ShapeDtypeStruct):
    return jnp.stack(layers)
  sharding = first.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = jax.sharding.PartitionSpec(None, *sharding.spec)
    sharding = jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
  return jax.ShapeDtypeStruct((len(layers), *first.shape), first.dtype, sharding=sharding)


def nnx_stages(
  model: Any,
  batch: Any,
  *,
  embed: Callable[[Any, Any], Any],
  blocks: str,
  head: Callable[[Any, Any, Any], jax.Array],
  block: Callable[[Any, Any, Any], Any] | None = None,
) -> NNXStages:
  """The stages of a Flax NNX ``model`` made of its own modules: ``loss = head(blocks(embed(batch)))``.

  Args:
    model: an ``nnx.Module`` (or ``nnx.eval_shape`` of one: only shapes are
      read) holding ``nnx.Param`` s only.
    batch: an example batch, arrays or ``jax.ShapeDtypeStruct`` s of any
      batch size: what ``OverlappedStep`` is called with.
    embed: ``embed(model, batch) -> x``, the first stage, through the model's
      own modules (e.g. ``lambda m, b: m.embed(b[0])``). It must not read the
      blocks.
    blocks: the attribute (a dotted path for a nested one) holding the
      repeated blocks: an ``nnx.List`` of modules, or one module
      whose every parameter is a stack of layers along its leading axis
      (``nnx.vmap``/``nnx.scan``).
    head: ``head(model, x, batch) -> loss``, the last stage, the scalar loss
      from the last block's output. It may read ``embed``'s parameters (tied
      weights), but not the blocks.
    block: ``block(layer, x, batch) -> x`` runs one layer (default
      ``layer(x)``).

  Returns an :class:`NNXStages`; its stages' functions are the same for
  layers of one structure, so all layers share one compiled program.
  """
  nnx = _nnx()
  if not isinstance(model, nnx.Module):
    raise TypeError(f"nnx_stages takes a flax.nnx.Module, got {type(model).__name__}.")
  _refuse_other_state(model)
  blocks_path = tuple(blocks.split("."))
  try:
    container = functools.reduce(getattr, blocks_path, model)
  except AttributeError:
    raise ValueError(f"nnx_stages: the model has no attribute {blocks!r} (blocks=, the repeated blocks).") from None
  graphdef, state = nnx.split(model, nnx.Param)
  pure = _abstract(nnx.to_pure_dict(state))
  stacked = isinstance(container, nnx.Module) and not isinstance(container, nnx.List)
  _check_no_sharing(container, stacked, _at(pure, blocks_path), blocks)
  layers, layer_keys = _layers(container, _at(pure, blocks_path), stacked, blocks, block)
  full = tuple(_flatten(pure))
  layout = tuple((p, s) for p, s in full if p[: len(blocks_path)] != blocks_path)
  ends = _groups_of_ends(graphdef, pure, layout, layers, _abstract(batch), embed, head)
  embed_paths, head_paths, head_reads_embed = ends
  n = len(layers)
  if not head_paths:  # the head reads embed's parameters only
    group_paths, head_groups, head_stage_paths = (embed_paths,), (0,), (embed_paths,)
  elif head_reads_embed:  # tied weights
    group_paths, head_groups, head_stage_paths = (embed_paths, head_paths), (n + 1, 0), (head_paths, embed_paths)
  else:
    group_paths, head_groups, head_stage_paths = (embed_paths, head_paths), (n + 1,), (head_paths,)
  stages = [
    Stage(_EndStage(graphdef, full, (embed_paths,), embed, head=False), (0,)),
    *(Stage(fn, (1 + i,)) for i, (fn, _) in enumerate(layers)),
    Stage(_EndStage(graphdef, full, head_stage_paths, head, head=True), head_groups),
  ]
  return NNXStages(stages, layout, group_paths, blocks_path, layer_keys, stacked)


def _refuse_other_state(model: Any) -> None:
  nnx = _nnx()
  other = nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))
  if len(other):
    found = ", ".join(f"{'/'.join(map(str, p))} ({type(v).__name__})" for p, v in list(other)[:6])
    more = f" and {len(other) - 6} more" if len(other) > 6 else ""
    raise ValueError(
      f"nnx_stages: the model holds state other than nnx.Param: {found}{more}. Its stages are pure functions of"
      " the parameters, so RNG streams (dropout), batch statistics, caches and plain arrays cannot reach them."
      " Build the model without that state (e.g. no nnx.Dropout with rngs, RMSNorm/LayerNorm for BatchNorm,"
      " constants computed in __call__), or train it on the plain path (nnx.value_and_grad, then the eager"
      " update: docs/api.md, 'Flax NNX')."
    )


def _layers(container, abstract: dict, stacked: bool, name: str, block) -> tuple[list, tuple]:
  """``([(stage function, the layer's abstract group)], keys)``: one function per distinct layer structure."""
  nnx = _nnx()
  functions: dict[Any, _LayerStage] = {}

  def stage_fn(module) -> _LayerStage:
    graphdef = nnx.graphdef(module)
    return functions.setdefault(graphdef, _LayerStage(graphdef, block))

  if stacked:
    leaves = jax.tree.leaves(abstract)
    sizes = {a.shape[0] if a.shape else None for a in leaves}
    if not leaves or len(sizes) != 1 or None in sizes:
      raise ValueError(
        f"nnx_stages: blocks={name!r} is one module, taken as a stack of layers (nnx.vmap/nnx.scan), but its"
        f" parameters' leading axes are {sorted(map(str, sizes))}: a stack has the layer count as every parameter's"
        " leading axis. Give an nnx.List of blocks otherwise."
      )
    fn, layer = stage_fn(container), jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract)
    return [(fn, layer)] * sizes.pop(), ()
  if not isinstance(container, Sequence) or not all(isinstance(m, nnx.Module) for m in container) or not container:
    raise ValueError(f"nnx_stages: blocks={name!r} must be an nnx.List of modules or one stacked module.")
  keys = tuple(range(len(container)))
  return [(stage_fn(m), abstract[k]) for k, m in zip(keys, container)], keys


def _check_no_sharing(container, stacked: bool, abstract: dict, name: str) -> None:
  """Refuses layers that share a parameter with each other or with the rest (each stage updates its own)."""
  nnx = _nnx()
  count = lambda module: len(jax.tree.leaves(nnx.state(module, nnx.Param)))  # noqa: E731
  own = count(container) if stacked else sum(count(m) for m in container)
  if own != len(jax.tree.leaves(abstract)):
    raise ValueError(
      f"nnx_stages: the layers of {name!r} share parameters with each other or with the rest of the model; each"
      " layer's stage updates its own parameters, so tie weights outside the blocks only."
    )


def _shapes(tree: Any) -> str:
  """``tree``'s arrays as ``dtype[shape]``, in its structure (for an error message)."""
  shown = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}" if hasattr(a, "shape") else repr(a), tree)
  return str(shown).replace("'", "")


def _traced(what: str, trace: Callable, *args: Any, batch: Any) -> Any:
  """``trace(*args)`` (a trace of the user's ``what`` on shapes), its errors said with what was traced and on what:
  the blocks read by ``embed`` or ``head``, or an example batch whose structure is not each step's."""
  try:
    return trace(*args)
  except TypeError as e:
    if "ShapeDtypeStruct" in str(e) and not what.startswith("block"):
      raise ValueError(
        "nnx_stages: embed or head reads the blocks' parameters; the blocks run in their own stages, so embed and"
        f" head may read only the other modules ({e})."
      ) from e
    error = e
  except (ValueError, IndexError, KeyError, AttributeError) as e:
    error = e
  raise ValueError(
    f"nnx_stages: {what} failed on the example batch {_shapes(batch)}: {type(error).__name__}: {error}. The example"
    " batch must be what OverlappedStep is called with each step, e.g. (tokens, targets), not the tokens alone;"
    " embed, the blocks and head must run on it as the model's own call does."
  ) from error


def _groups_of_ends(graphdef, pure, layout, layers, batch, embed, head) -> tuple[tuple, tuple, bool]:
  """``(embed's paths, the head group's paths, whether the head reads embed's group)``, traced on shapes."""
  nnx = _nnx()
  paths = [p for p, _ in layout]
  blocks = [(p, s) for p, s in _flatten(pure) if p not in dict(layout)]

  def call(values, x, batch, fn, is_head):
    model = nnx.merge(graphdef, _nest([*zip(paths, values), *blocks]))
    return fn(model, x, batch) if is_head else fn(model, batch)

  values = [s for _, s in layout]
  traced = functools.partial(_traced, batch=batch)
  x = traced("embed(model, batch)", jax.eval_shape, functools.partial(call, fn=embed, is_head=False), values, None,
             batch)  # fmt: skip
  seen: dict = {}
  for i, (fn, layer) in enumerate(layers):  # the last block's output, each distinct (layer, input) traced once
    key = (fn, jax.tree.structure(layer), tuple(jax.tree.leaves(layer)), jax.tree.structure(x),
           tuple(jax.tree.leaves(x)))  # fmt: skip
    if key not in seen:
      seen[key] = traced(f"block {i} on embed's output {_shapes(x)}", jax.eval_shape, fn, (layer,), x, batch)
    x = seen[key]
  embed_used = _used_inputs(jax.make_jaxpr(functools.partial(call, fn=embed, is_head=False))(values, None, batch),
                            len(values))  # fmt: skip
  closed = traced(f"head(model, x, batch) on the last block's output {_shapes(x)}", jax.make_jaxpr(
    functools.partial(call, fn=head, is_head=True)), values, x, batch)  # fmt: skip
  loss = closed.out_avals
  if len(loss) != 1 or loss[0].shape != ():
    raise ValueError(f"nnx_stages: head must return the scalar loss; it returns {[a.str_short() for a in loss]}.")
  head_used = _used_inputs(closed, len(values))
  if not embed_used:
    raise ValueError("nnx_stages: embed reads no parameter; the first stage needs parameters of its own.")
  embed_paths = tuple(paths[i] for i in embed_used)
  rest = tuple(p for i, p in enumerate(paths) if i not in set(embed_used))
  return embed_paths, rest, bool(set(head_used) & set(embed_used))
