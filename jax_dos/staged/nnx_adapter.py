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

Randomness: the stages draw from the model's own RNG streams
(``nnx.Dropout(rate, rngs=...)``'s, an ``nnx.Rngs`` a module keeps) the keys
the plain path draws (``nnx.value_and_grad`` over the model, once per
micro-batch), in the forward program and its rematerialised backward alike:
their keys and counters are ``Stage.inputs``, taken by :meth:`NNXStages.give`
and written back by :meth:`NNXStages.update` (``jax_dos.staged.stage_rng``: the
contract, and what it refuses). A model called with its keys
(``model(tokens, rngs=rngs)``, keys no part of its state) is given that
``nnx.Rngs`` as ``nnx_stages(..., rngs=rngs)``: its functions are then called
with ``rngs=`` too, and the stages draw from it as the plain call does. A
``block`` taking a fourth parameter gets the layer's index, ``block(layer, x,
batch, index)`` (an int32 scalar). Other state (batch statistics, caches,
plain arrays) is refused, with its paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from jax_dos.hand_off import Given
from jax_dos.staged import nnx_stage_fns as fns
from jax_dos.staged import stage_rng
from jax_dos.staged.stages import Stage

Path = fns.Path


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

  def __init__(self, stages, layout, group_paths, blocks_path, layer_keys, stacked, streams=None, rngs=None):
    self.stages: tuple[Stage, ...] = tuple(stages)
    self._streams: stage_rng.Streams | None = streams  # the RNG streams the stages draw from
    self._rngs: Any = rngs  # the streams given at call time (nnx_stages(rngs=)), or None
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
    nnx = fns.nnx_module()
    if isinstance(tree, nnx.Module):
      tree = nnx.state(tree, nnx.Param)
    if isinstance(tree, nnx.State):
      tree = nnx.to_pure_dict(tree)
    try:
      ends = [fns.nest([(p, fns.at(tree, p)) for p in paths]) for paths in self._group_paths]
      blocks = fns.at(tree, self._blocks_path)
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
    donated them). The stages draw from the model's RNG streams, and those of ``nnx_stages(rngs=)``, as they stand
    now (their keys and counters)."""
    nnx = fns.nnx_module()
    if not isinstance(model, nnx.Module):
      raise TypeError(f"NNXStages.give takes the flax.nnx.Module itself, got {type(model).__name__}.")
    groups = self.split(model)
    if self._streams is not None:
      self._streams.capture(model, self._rngs)  # the stages draw from the streams as they stand now
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
    items = [(p, fns.at(g, p)) for paths, g in zip(self._group_paths, ends) for p in paths]
    if self.stacked:
      blocks = jax.tree.map(_stack, *layers)
    else:
      blocks = dict(zip(self._layer_keys, layers))
    return fns.nest([*items, (self._blocks_path, blocks)])

  def update(self, model: Any, groups: Sequence[Any]) -> None:
    """Writes ``groups`` (``OverlappedStep.params``) into ``model``'s parameters, in place (``nnx.update``), and its
    RNG counters where they were drawn from, and those of ``nnx_stages(rngs=)``: as the plain path leaves them after
    the steps taken since :meth:`give` (``jax_dos.staged.stage_rng``)."""
    nnx, tree = fns.nnx_module(), self.merge(groups)
    counters, called = stage_rng.split_called(list(({} if self._streams is None else self._streams.counters()).items()))
    nnx.update(model, fns.nest([*fns.flatten(tree), *counters]) if counters else tree)
    if called:
      nnx.update(self._rngs, fns.nest(called))


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
  rngs: Any = None,
) -> NNXStages:
  """The stages of a Flax NNX ``model`` made of its own modules: ``loss = head(blocks(embed(batch)))``.

  Args:
    model: an ``nnx.Module`` (or ``nnx.eval_shape`` of one: only shapes are
      read) holding ``nnx.Param`` s and RNG streams only.
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
      ``layer(x)``); ``block(layer, x, batch, index)`` (a fourth positional
      parameter other than ``rngs``) also gets the layer's index, an int32
      scalar.
    rngs: the ``nnx.Rngs`` (or ``nnx.RngStream``) the model is called with,
      for a model whose ``__call__`` takes its keys as ``rngs=`` (no part of
      its state). Then ``embed``, ``head`` and ``block`` are called with it as
      ``rngs=`` too (default block ``layer(x, rngs=rngs)``), and the stages
      draw from it what ``model(tokens, rngs=rngs)`` draws, one forward call
      per micro-batch, the one ``Rngs`` counting on from call to call and step
      to step (as an ``nnx.jit`` step given it each step): the layers one
      after another, as a loop over them does (or ``nnx.scan`` carrying
      ``rngs``). :meth:`NNXStages.give` takes its keys and counters as they
      stand, :meth:`NNXStages.update` writes its counters back.

  Returns an :class:`NNXStages`; its stages' functions are the same for
  layers of one structure, so all layers share one compiled program.
  """
  nnx = fns.nnx_module()
  if not isinstance(model, nnx.Module):
    raise TypeError(f"nnx_stages takes a flax.nnx.Module, got {type(model).__name__}.")
  _refuse_other_state(model)
  blocks_path = tuple(blocks.split("."))
  try:
    container = functools.reduce(getattr, blocks_path, model)
  except AttributeError:
    raise ValueError(f"nnx_stages: the model has no attribute {blocks!r} (blocks=, the repeated blocks).") from None
  graphdef, state, _ = nnx.split(model, nnx.Param, nnx.RngState)
  pure, rng, called = fns.abstract(nnx.to_pure_dict(state)), stage_rng.leaves(model), None
  if rngs is not None:  # the call-time streams' keys and counters beside the model's
    called = (*stage_rng.called_leaves(model, rngs), nnx.graphdef(rngs))
    rng = (rng[0] + called[0], rng[1] + called[1])
  stacked = isinstance(container, nnx.Module) and not isinstance(container, nnx.List)
  _check_no_sharing(container, stacked, fns.at(pure, blocks_path), blocks)
  found = _layers(model, container, fns.at(pure, blocks_path), stacked, blocks, block, blocks_path, called)
  layers, layer_keys, called_def = *found, None if called is None else called[2]
  full = (*fns.flatten(pure), *rng[0], *rng[1])  # every parameter, key and counter: the end stages' model
  layout = tuple((p, s) for p, s in fns.flatten(pure) if p[: len(blocks_path)] != blocks_path)
  found = _groups_of_ends(graphdef, full, layout, rng, layers, fns.abstract(batch), embed, head, called_def)
  embed_paths, head_paths, head_reads_embed, uses = found
  n = len(layers)
  if not head_paths:  # the head reads embed's parameters only
    group_paths, head_groups, head_stage_paths = (embed_paths,), (0,), (embed_paths,)
  elif head_reads_embed:  # tied weights
    group_paths, head_groups, head_stage_paths = (embed_paths, head_paths), (n + 1, 0), (head_paths, embed_paths)
  else:
    group_paths, head_groups, head_stage_paths = (embed_paths, head_paths), (n + 1,), (head_paths,)
  read = tuple(tuple(p for p, _ in x) for x in rng)  # the end stages traced reading every key and counter
  ends = [(fns.EndStage(graphdef, full, paths, fn, is_head, *read, called=called_def), None, *rng,
           *([(p, None) for p in x] for x in read))
          for paths, fn, is_head in (((embed_paths,), embed, False), (head_stage_paths, head, True))]  # fmt: skip
  functions, draws = stage_rng.drawing([ends[0], *layers, ends[1]], [uses[0], *uses[1], uses[2]])
  streams = stage_rng.Streams(draws, [None, *(i if fn.index else None for i, fn in enumerate(functions[1:-1])), None])
  streams.capture(model, rngs)
  groups, inputs = [(0,), *((1 + i,) for i in range(n)), head_groups], streams.inputs_of
  stages = [Stage(fn, g, inputs=i) for fn, g, i in zip(functions, groups, inputs)]
  used = any(i is not None for i in inputs)
  return NNXStages(stages, layout, group_paths, blocks_path, layer_keys, stacked, streams if used else None, rngs)


def _refuse_other_state(model: Any) -> None:
  nnx = fns.nnx_module()
  other = nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Any(nnx.Param, nnx.RngState))))
  if len(other):
    found = ", ".join(f"{'/'.join(map(str, p))} ({type(v).__name__})" for p, v in list(other)[:6])
    more = f" and {len(other) - 6} more" if len(other) > 6 else ""
    raise ValueError(
      f"nnx_stages: the model holds state other than nnx.Param and RNG streams: {found}{more}. Its stages are"
      " functions of the parameters and the RNG streams' keys and counters, so batch statistics, caches and plain"
      " arrays cannot reach them. Build the model without that state (e.g. RMSNorm/LayerNorm for BatchNorm,"
      " constants computed in __call__), or train it on the plain path (nnx.value_and_grad, then the eager"
      " update: docs/api.md, 'Flax NNX')."
    )


def _layers(model, container, abstract, stacked: bool, name: str, block, blocks_path, called) -> tuple[list, tuple]:
  """``([(stage function, the layer's abstract group, its RNG keys, counters and their ids)], keys)``
  (``stage_rng.of_layers``): one function per distinct layer structure, given its every key and counter to read.
  ``called``: ``(keys, counters, graphdef)`` of the streams given at call time, which every layer is given whole."""
  nnx = fns.nnx_module()
  functions: dict[Any, fns.LayerStage] = {}
  index = stage_rng.takes_index(block)
  called_def, more = (None, ((), ())) if called is None else (called[2], called[:2])

  def layer(module, group, keys, counts, key_ids, count_ids) -> tuple:
    graphdef = nnx.graphdef(module)
    keys, counts = [*keys, *more[0]], [*counts, *more[1]]
    key_ids, count_ids = [*key_ids, *((p, None) for p, _ in more[0])], [*count_ids, *((p, None) for p, _ in more[1])]
    paths = tuple(p for p, _ in keys), tuple(p for p, _ in counts)
    fn = functions.setdefault(graphdef, fns.LayerStage(graphdef, block, *paths, index=index, called=called_def))
    return fn, group, keys, counts, key_ids, count_ids

  if stacked:
    leaves = jax.tree.leaves(abstract)
    sizes = {a.shape[0] if a.shape else None for a in leaves}
    if not leaves or len(sizes) != 1 or None in sizes:
      raise ValueError(
        f"nnx_stages: blocks={name!r} is one module, taken as a stack of layers (nnx.vmap/nnx.scan), but its"
        f" parameters' leading axes are {sorted(map(str, sizes))}: a stack has the layer count as every parameter's"
        " leading axis. Give an nnx.List of blocks otherwise."
      )
    size, group = sizes.pop(), jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract)
    return [layer(container, group, *rng) for rng in stage_rng.of_layers(model, container, size, blocks_path,
                                                                          name)], ()  # fmt: skip
  if not isinstance(container, Sequence) or not all(isinstance(m, nnx.Module) for m in container) or not container:
    raise ValueError(f"nnx_stages: blocks={name!r} must be an nnx.List of modules or one stacked module.")
  keys, rngs = tuple(range(len(container))), stage_rng.of_layers(model, container, None, blocks_path, name)
  return [layer(m, abstract[k], *rng) for k, m, rng in zip(keys, container, rngs)], keys


def _check_no_sharing(container, stacked: bool, abstract: dict, name: str) -> None:
  """Refuses layers that share a parameter with each other or with the rest (each stage updates its own)."""
  nnx = fns.nnx_module()
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


def _groups_of_ends(graphdef, full, layout, rng, layers, batch, embed, head, called) -> tuple:
  """``(embed's paths, the head group's paths, whether the head reads embed's group, RNG uses)``, traced on shapes.

  The RNG uses are ``(embed's, each layer's, the head's)``, each ``stage_rng.uses``': the keys and counters the
  stage reads (of the model's, of its layer's, of those given at call time: ``called``, their graphdef or ``None``)
  and the keys it draws from each counter in one call.
  """
  paths, (keys, counts) = tuple(p for p, _ in layout), rng
  group, traced = fns.nest(layout), functools.partial(_traced, batch=batch)

  def trace(what, fn, params, x, keys, counts, index=None):
    closed, (out, _) = traced(what, jax.make_jaxpr(fn.run, return_shape=True), params, x, batch, keys, counts, index)
    first = len(jax.tree.leaves((params, x, batch)))
    ranges = range(first, first + len(keys)), range(first + len(keys), first + len(keys) + len(counts))
    return closed, out, stage_rng.uses(closed, *ranges, len(jax.tree.leaves(out)), what.split(" on ")[0])

  def end(fn, is_head):
    return fns.EndStage(
      graphdef, full, (paths,), fn, is_head, tuple(p for p, _ in keys), tuple(p for p, _ in counts), called=called
    )

  values = ((group,), [s for _, s in keys], [s for _, s in counts])
  e_closed, x, embed_use = trace("embed(model, batch)", end(embed, False), values[0], None, *values[1:])
  seen: dict = {}
  layer_uses = []
  for i, (fn, layer, layer_keys, layer_counts, _, _) in enumerate(layers):  # each distinct (layer, input) once
    key = (fn, jax.tree.structure(layer), tuple(jax.tree.leaves(layer)), jax.tree.structure(x),
           tuple(jax.tree.leaves(x)))  # fmt: skip
    if key not in seen:
      index = jax.ShapeDtypeStruct((), jnp.int32) if fn.index else None
      seen[key] = trace(f"block {i} on embed's output {_shapes(x)}", fn, (layer,), x, [s for _, s in layer_keys],
                        [s for _, s in layer_counts], index)[1:]  # fmt: skip
    x, use = seen[key]
    layer_uses.append(use)
  closed, loss, head_use = trace(f"head(model, x, batch) on the last block's output {_shapes(x)}", end(head, True),
                                 values[0], x, *values[1:])  # fmt: skip
  if len(jax.tree.leaves(loss)) != 1 or jax.tree.leaves(loss)[0].shape != ():
    raise ValueError(f"nnx_stages: head must return the scalar loss; it returns {_shapes(loss)}.")
  embed_used, head_used = fns.used_inputs(e_closed, len(paths)), fns.used_inputs(closed, len(paths))
  if not embed_used:
    raise ValueError("nnx_stages: embed reads no parameter; the first stage needs parameters of its own.")
  embed_paths = tuple(paths[i] for i in embed_used)
  rest = tuple(p for i, p in enumerate(paths) if i not in set(embed_used))
  return embed_paths, rest, bool(set(head_used) & set(embed_used)), (embed_use, layer_uses, head_use)
