"""Randomness in a Flax NNX model's stages (``jax_dos.nnx_stages``): its RNG streams, drawn as the plain path draws.

An NNX stream (``nnx.RngStream``: an ``nnx.RngKey`` and an ``nnx.RngCount``;
each ``nnx.Dropout(rate, rngs=...)`` forks its own, and a module may keep an
``nnx.Rngs``) draws ``jax.random.fold_in(key, count)`` and counts one up at
each draw. On the plain path (``nnx.value_and_grad`` of the loss over the
model) each forward call draws from the streams as it reaches them. The
stages draw the same keys:

* forward call ``n`` is micro-batch ``m`` of the ``s``-th step taken since
  ``NNXStages.give`` (``n = s * k + m`` with ``k`` micro-batches): a plain
  loop calling the model once per micro-batch draws as the step does;
* within a call the stages draw in forward order: embed, layer ``0 .. L-1``,
  head. How many keys stage ``j`` draws from each counter in one call,
  ``d_j``, is found once by tracing the stage on shapes and evaluating the
  counters alone (NNX counts one up per draw whatever the data; a counter
  advanced by data is refused). A counter drawn ``D`` times a call, ``o_j`` of
  them by the stages before ``j``, stands at ``count0 + n * D + o_j`` when
  stage ``j`` runs call ``n``;
* each stage with a stream gets ``Stage.inputs`` (:class:`StageInputs`):
  ``{"keys", "bases", "strides", "call"}``, its streams' keys, ``count0 +
  o_j`` and ``D`` (taken from the model by ``give``) and ``n`` (a scalar per
  micro-batch, moved on by the step). The stage rebuilds its modules with the
  counters at ``bases + call * strides`` (uint32, wrapping as NNX's ``+= 1``
  does), so its forward program and its rematerialised backward draw the same
  keys;
* ``NNXStages.update`` writes the counters back, ``count0 + calls * D``: the
  model goes on drawing where the plain path would.

A layer of an ``nnx.List`` draws from its own streams or from one it shares
with other layers or the rest (an ``nnx.Rngs`` several modules keep), each
as the plain path does. A stack's layer ``i`` draws from slice ``i`` of the
stack's streams, which must be split per layer (``nnx.split_rngs`` around the
``nnx.vmap`` that builds it: what ``nnx.scan`` draws from); others are
refused. A key or counter a stage neither draws from nor computes with is no
input of it (:func:`stand_in` takes its place): a model in ``eval`` mode
(``nnx.Dropout(deterministic=True)`` draws nothing) gives stages with no
random input. A layer's stage also gets ``"index"`` (int32, the layer's)
where ``block`` takes it: ``block(layer, x, batch, index)``.

Keys given at call time (``model(tokens, rngs=rngs)``: an ``nnx.Rngs`` no
part of the model's state, ``nnx_stages(..., rngs=rngs)``) are one more
stream, its keys and counters under the path :data:`CALLED`, that every stage
reads whole: the stages draw from it in forward order, as the plain path's
call passing it to each module in turn, and the one ``Rngs`` counts on from
call to call (as an ``nnx.jit`` step given it each step carries its
counters). A stack's layers draw from it one after another, as a loop over
them does (``nnx.scan`` carrying ``rngs``; one broadcasting it draws one key
for every layer). A bare key is refused: a new key each step would be an
input the step does not take.

On a mesh of several processes (``jax.distributed``) the inputs are put on
the parameters' mesh, replicated; a key or counter each process holds alone
(an ``nnx.Rngs`` made from a seed in every process) goes there by its value,
which must be every process's, as the plain path's replicated keys are.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Path = tuple[Any, ...]
Id = tuple[Path, Any]  # a counter or key of the model: (its path in the model's state, its layer's slice or None)


Leaves = list[tuple[Path, jax.ShapeDtypeStruct]]


def leaves(module: Any) -> tuple[Leaves, Leaves]:
  """``(keys, counters)``: the ``(path, shape)`` of each RNG key and counter of ``module`` (``nnx.RngState``)."""
  from flax import nnx

  state = nnx.state(module, nnx.RngState)
  values = _values(state)
  shaped = [(p, jax.ShapeDtypeStruct(np.shape(values[p]), values[p].dtype), isinstance(v, nnx.RngCount))
            for p, v in nnx.to_flat_state(state)]  # fmt: skip
  return [(p, s) for p, s, c in shaped if not c], [(p, s) for p, s, c in shaped if c]


def _values(state: Any) -> dict[Path, Any]:
  """The arrays of an ``nnx.State`` by path (as ``nnx.to_pure_dict``)."""
  from flax import nnx

  out, pure = {}, nnx.to_pure_dict(state)
  for p, _ in nnx.to_flat_state(state):
    out[p] = functools.reduce(lambda node, key: node[key], p, pure)
  return out


def of_layers(model: Any, container: Any, size: int | None, blocks: Path, name: str) -> list[tuple]:
  """Per layer ``(keys, counters, key ids, counter ids)``: its RNG keys and counters (:func:`leaves`, a stack's
  sliced) and what each is in the model (:data:`Id`). ``size``: a stack's layers (``None``: an ``nnx.List``)."""
  from flax import nnx

  canonical = {id(v): p for p, v in nnx.iter_graph(model) if isinstance(v, nnx.RngState)}
  variables = lambda m: {p: v for p, v in nnx.iter_graph(m) if isinstance(v, nnx.RngState)}  # noqa: E731
  if size is None:
    out = []
    for module in container:
      (keys, counts), found = leaves(module), variables(module)
      out.append((keys, counts, *([(canonical[id(found[p])], None) for p, _ in x] for x in (keys, counts))))
    return out
  (keys, counts), found = leaves(container), variables(container)
  for p, s in (*keys, *counts):
    if canonical[id(found[p])] != (*blocks, *p) or s.shape[:1] != (size,):
      raise ValueError(
        f"nnx_stages: the RNG stream {'/'.join(map(str, (*blocks, *p)))} of the stack {name!r} is not split per"
        f" layer (leading axis {list(s.shape[:1])} for {size} layers, or shared with the rest of the model); build"
        f" the stack with nnx.split_rngs(splits={size}) around the nnx.vmap that makes it, as nnx.scan draws from"
        " a stream per layer."
      )
  sliced = lambda x: [(p, jax.ShapeDtypeStruct(s.shape[1:], s.dtype)) for p, s in x]  # noqa: E731
  return [(sliced(keys), sliced(counts), *([((*blocks, *p), i) for p, _ in x] for x in (keys, counts)))
          for i in range(size)]  # fmt: skip


CALLED = "(rngs)"  # the top of the paths of the streams given at call time (rngs=): no attribute's name


def called_leaves(model: Any, rngs: Any) -> tuple[Leaves, Leaves]:
  """``(keys, counters)`` of ``rngs``, the RNG streams a model is given at call time (``model(x, rngs=rngs)``),
  each path under :data:`CALLED`: what :func:`leaves` is for the model's own streams. ``rngs`` must be an
  ``nnx.Rngs`` or ``nnx.RngStream`` that is no part of ``model``."""
  from flax import nnx

  if not isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
    what = "a key array" if isinstance(rngs, jax.Array) else type(rngs).__name__
    raise TypeError(
      f"nnx_stages: rngs= takes the nnx.Rngs (or nnx.RngStream) the model is called with, model(x, rngs=rngs); got"
      f" {what}. A bare key would be a new input each step, which the stages have no place for: give"
      " nnx.Rngs(dropout=key) (the stages then draw what model(x, rngs=rngs) draws, that one Rngs counting on from"
      " call to call), or keep an nnx.Rngs in the model."
    )
  own = {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngState)}
  if any(id(v) in own for _, v in nnx.iter_graph(rngs) if isinstance(v, nnx.RngState)):
    raise ValueError(
      "nnx_stages: rngs= is a stream the model also keeps; the stages take a stream either from the model's state"
      " or as rngs=, not both: leave rngs= out (the model's own streams are drawn from), or keep the stream out of"
      " the model."
    )
  keys, counts = leaves(rngs)
  return [((CALLED, *p), s) for p, s in keys], [((CALLED, *p), s) for p, s in counts]


def split_called(items: Sequence[tuple[Path, Any]]) -> tuple[list, list]:
  """``items`` (``(path, value)``) as ``(the model's, the call-time streams' with CALLED taken off)``."""
  mine = [(p, v) for p, v in items if not p or p[0] != CALLED]
  return mine, [(p[1:], v) for p, v in items if p and p[0] == CALLED]


def counters(module: Any, paths: Sequence[Path], called: Any = None) -> tuple:
  """The values of the RNG counters at ``paths`` of ``module`` and of ``called`` (the streams given at call time,
  paths under :data:`CALLED`): after a call, where its draws left them."""
  from flax import nnx

  if not paths:
    return ()
  counts = nnx.to_pure_dict(nnx.state(module, nnx.RngCount))
  if called is not None:
    counts = {**counts, CALLED: nnx.to_pure_dict(nnx.state(called, nnx.RngCount))}
  return tuple(functools.reduce(lambda node, key: node[key], p, counts) for p in paths)


def takes_index(block: Callable | None) -> bool:
  """Whether ``block`` takes a fourth positional parameter other than ``rngs``: the layer's index."""
  try:
    parameters = inspect.signature(block).parameters.values() if block is not None else ()
  except (TypeError, ValueError):
    return False
  kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  return len([p for p in parameters if p.kind in kinds and p.name != "rngs"]) >= 4


def drawing(stages: Sequence[tuple], uses: Sequence[tuple]) -> tuple[list, list]:
  """``(the stage functions, per stage (key ids, counter ids, draws a call))`` from the traced ``uses`` (each
  :func:`uses`'). ``stages``: per stage ``(fn, group, keys, counters, key ids, counter ids)``, ``fn`` traced reading
  them all; each function is given those it reads (``keys``, ``counts``), the others stand in (``absent``)."""
  fns, draws, remade = [], [], {}
  for (fn, _, keys, counts, key_ids, count_ids), (read_keys, read_counts, drawn) in zip(stages, uses):
    read_keys = [u or not _stands_in(s) for (_, s), u in zip(keys, read_keys)]
    read_counts = [u or not _stands_in(s) for (_, s), u in zip(counts, read_counts)]
    read = [*read_keys, *read_counts]
    key = (fn, *read)
    if key not in remade:  # layers of one structure (reading alike): one function
      remade[key] = dataclasses.replace(fn, keys=tuple(p for (p, _), u in zip(keys, read_keys) if u),
                                       counts=tuple(p for (p, _), u in zip(counts, read_counts) if u),
                                       absent=tuple(x for x, u in zip((*keys, *counts), read) if not u))  # fmt: skip
    fns.append(remade[key])
    draws.append((tuple(i for i, u in zip(key_ids, read_keys) if u), tuple(i for i, u in zip(count_ids, read_counts)
                  if u), tuple(d for d, u in zip(drawn, read_counts) if u)))  # fmt: skip
  return fns, draws


def _stands_in(shape: jax.ShapeDtypeStruct) -> bool:
  """Whether :func:`stand_in` makes a value of ``shape``: a counter, or a key of jax's default kind."""
  return shape.dtype == np.uint32 or shape.dtype == jax.random.key(0).dtype


def stand_in(shape: jax.ShapeDtypeStruct) -> jax.Array:
  """A key or counter a stage does not read (its output depends on it nowhere, it draws nothing from it): zeros,
  or ``key(0)``, so that transformations the module passes its state through (``nnx.remat``) get arrays."""
  if shape.dtype == np.uint32:
    return jnp.zeros(shape.shape, np.uint32)
  return jnp.broadcast_to(jax.random.key(0), shape.shape)


def unpack(inputs: Any) -> tuple[tuple, tuple, Any]:
  """``(keys, counters, index)`` of a stage's inputs: the counters at this call, ``bases + call * strides``."""
  if inputs is None:
    return (), (), None
  call = inputs.get("call")
  counts = tuple(b + call * s for b, s in zip(inputs.get("bases", ()), inputs.get("strides", ())))
  return tuple(inputs.get("keys", ())), counts, inputs.get("index")


def uses(closed: Any, keys: range, counts: range, outputs: int, what: str) -> tuple[list[bool], list[bool], list]:
  """``(keys read, counters read, draws per counter)`` of a stage traced as ``run``: its flat inputs hold the keys
  at ``keys`` and the counters at ``counts``, its outputs the stage's ``outputs`` leaves, then the counters.

  A key or counter is read where the stage's output depends on it, or the stage draws from it. The draws are the
  counters after the call less before, evaluated from the counters alone: the jaxpr cut to what the counters after
  depend on (jax's dead-code elimination, which sees into ``nnx.remat``, ``jit`` and ``scan``), which must read no
  other input.
  """
  from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: jax's own, stable since 0.3

  jaxpr, consts = closed.jaxpr, len(closed.jaxpr.constvars)
  whole, outs = pe.convert_constvars_jaxpr(jaxpr), range(len(jaxpr.outvars))
  by_output = pe.dce_jaxpr(whole, [i < outputs for i in outs])[1][consts:]
  if len(jaxpr.outvars) == outputs:
    return [by_output[i] for i in keys], [by_output[i] for i in counts], []
  small, used = pe.dce_jaxpr(whole, [i >= outputs for i in outs])
  if any(u and i - consts not in counts for i, u in enumerate(used) if i >= consts):
    raise ValueError(
      f"nnx_stages: {what} advances an RNG counter by an amount that depends on its data or parameters; the"
      " stages draw as the plain path only where each call draws a fixed number of keys (nnx.Dropout, a stream"
      " called a fixed number of times)."
    )
  given = [*closed.consts, *jaxpr.invars]

  def run(start: int) -> list[np.ndarray]:
    args = [a if i < consts else np.full(a.aval.shape, start, np.uint32) for i, a in enumerate(given) if used[i]]
    return [np.asarray(a, np.uint32) for a in jax.core.eval_jaxpr(small, [], *args)]

  after, later = run(0), run(7)
  if any(np.any(b - a != 7) for a, b in zip(after, later)):
    raise ValueError(f"nnx_stages: {what} sets an RNG counter other than by counting up from where it stands.")
  return [by_output[i] for i in keys], [by_output[i] or bool(np.any(after[j])) for j, i in enumerate(counts)], after


def _replicated(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """``value`` on ``sharding``, a mesh of several processes. A key or counter this process holds alone (an
  ``nnx.Rngs`` made from a seed in each process, or a scalar) goes through its value, which must be every
  process's (as replicated arrays are); one already on the mesh is moved as it is."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return jax.device_put(value, sharding)
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    data = jax.device_put(np.asarray(jax.random.key_data(value)), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
  return jax.device_put(np.asarray(value), sharding)


class StageInputs:
  """One stage's ``Stage.inputs``: :meth:`at` micro-batch ``m`` of the coming step, :meth:`advance` after a step."""

  def __init__(self, streams: Streams, stage: int):
    self.streams, self.stage, self.calls = streams, stage, 0

  def at(self, micro_batch: int) -> dict:
    return self.streams.inputs(self.stage, self.calls + micro_batch)

  def advance(self, micro_batches: int) -> None:
    self.calls += micro_batches


class Streams:
  """A model's RNG streams as its stages draw them: per stage, the keys and counters it reads and how many keys it
  draws a call (``stages[j] = (key ids, counter ids, draws)``, ids :data:`Id`), and the layers' indices."""

  def __init__(self, stages: Sequence[tuple[tuple, tuple, tuple]], indices: Sequence[int | None]):
    self._stages = [(tuple(k), tuple(c), tuple(np.asarray(x, np.uint32) for x in d)) for k, c, d in stages]
    drawn: dict[Id, np.ndarray] = {}
    self._offsets = []  # per stage, per counter: what the stages before it draw in one call
    for _, ids, draws in self._stages:
      self._offsets.append(tuple(drawn.get(i, np.zeros_like(d)) for i, d in zip(ids, draws)))
      for i, d in zip(ids, draws):
        drawn[i] = drawn.get(i, np.zeros_like(d)) + d
    self._per_call = drawn  # D: each counter's draws in one call
    reads = [bool(keys or counts) or i is not None for (keys, counts, _), i in zip(self._stages, indices)]
    self.inputs_of = [StageInputs(self, j) if r else None for j, r in enumerate(reads)]  # each stage's Stage.inputs
    self._indices = [None if i is None else jnp.int32(i) for i in indices]
    self._consts: list[dict] | None = None
    self._count0: dict[Path, Any] = {}
    self._calls: dict[int, jax.Array] = {}
    self._sharding: Any = None

  @property
  def random(self) -> bool:
    """Whether any stage reads a key or counter (a model in ``eval`` mode: none)."""
    return any(k or c for k, c, _ in self._stages)

  def capture(self, model: Any, called: Any = None) -> None:
    """Takes the model's keys and counters (``give``), and those of ``called`` (the streams given at call time,
    ``rngs=``): the stages draw from them, counting calls from 0."""
    from flax import nnx

    if not self.random:
      return
    values = _values(nnx.state(model, nnx.RngState))
    if called is not None:
      values.update({(CALLED, *p): v for p, v in _values(nnx.state(called, nnx.RngState)).items()})
    if not all(isinstance(v, jax.Array) for v in values.values()):
      return  # an abstract model (nnx.eval_shape): give(model) takes them
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    sharding = getattr(params[0], "sharding", None) if params else None
    if isinstance(sharding, jax.sharding.NamedSharding):  # the inputs on the parameters' mesh, replicated
      self._sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
      self._indices = self._put(self._indices)
    at = lambda i: values[i[0]] if i[1] is None else values[i[0]][i[1]]  # noqa: E731
    self._consts = []
    for (keys, counts, _), offsets in zip(self._stages, self._offsets):
      if not (keys or counts):
        self._consts.append({})
        continue
      self._consts.append(self._put({
        "keys": tuple(at(i) for i in keys), "bases": tuple(at(i) + jnp.asarray(o) for i, o in zip(counts, offsets)),
        "strides": tuple(jnp.asarray(self._per_call[i]) for i in counts),
      }))  # fmt: skip
    self._count0 = {p: values[p] for p in {i[0] for i in self._per_call}}
    self._calls = {}
    for inputs in self.inputs_of:
      if inputs is not None:
        inputs.calls = 0

  def _put(self, tree: Any) -> Any:
    """``tree`` replicated on the parameters' mesh (as it is where they have none)."""
    if self._sharding is None:
      return tree
    if self._sharding.is_fully_addressable:
      return jax.device_put(tree, self._sharding)
    return jax.tree.map(functools.partial(_replicated, sharding=self._sharding), tree)

  def inputs(self, stage: int, call: int) -> dict:
    """Stage ``stage``'s inputs for the model's forward call ``call`` since :meth:`capture`."""
    tree = {} if self._indices[stage] is None else {"index": self._indices[stage]}
    keys, counts, _ = self._stages[stage]
    if not (keys or counts):
      return tree
    if self._consts is None:
      raise ValueError(
        "NNXStages: the stages draw from the model's RNG streams, which give(model) takes from a model holding"
        " arrays; this one's keys and counters are shapes only (nnx.eval_shape): build it, or nnx.update them."
      )
    if call not in self._calls:
      if len(self._calls) > 64:
        self._calls.clear()
      self._calls[call] = self._put(jnp.uint32(call))
    return {**tree, **self._consts[stage], "call": self._calls[call]}

  def counters(self) -> dict[Path, jax.Array]:
    """The model's counters after the calls the step took (``count0 + calls * D``), by path (those of the streams
    given at call time under :data:`CALLED`): what ``update`` writes back. Empty before :meth:`capture`."""
    if self._consts is None:
      return {}
    calls = max((i.calls for i in self.inputs_of if i is not None), default=0)
    per_call: dict[Path, np.ndarray] = collections.defaultdict(lambda: np.zeros((), np.uint32))
    for (path, where), d in self._per_call.items():
      if where is None:
        per_call[path] = per_call[path] + d
      else:
        total = np.zeros(np.shape(self._count0[path]), np.uint32)
        total[where] = d
        per_call[path] = per_call[path] + total
    return {p: self._count0[p] + jnp.asarray(np.uint32(calls) * d) for p, d in per_call.items()}
