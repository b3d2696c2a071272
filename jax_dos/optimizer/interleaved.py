"""The optimizer behind ``interleaved_adam``: hyperparameters, a plan and an engine per tree signature.

:class:`InterleavedAdam` holds what ``jax_dos.interleaved_adam`` was given and
runs ``init`` and ``update``. ``update`` takes one of two ways, with the same
arithmetic (``adam_math.py``):

* **traced** (called inside ``jax.jit``, or under ``optax.MultiSteps`` whose
  ``lax.cond`` traces it): pure XLA with in-jit ``device_put`` (``traced.py``);
* **eager** (called on concrete arrays): the engine (``engine.py``), which
  pipelines streamed subgroups and runs the host kernel concurrently. This is
  the fast path; it consumes ``state`` like a donated argument.

The transformation ``interleaved_adam`` returns, an
:class:`InterleavedAdamTransformation`, carries its optimizer as
``tx.interleaved``; :func:`find_interleaved` also finds it inside a
combination of transformations (``optax.chain``, ``jax_dos.multi_steps``).
The plan comes from a planner the caller gives (``plan="auto"``) or from
``plan`` itself; this module knows nothing of how a planner decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_dos.core import moment_formats, partition
from jax_dos.core.adam_math import AdamHyper
from jax_dos.core.state import InterleavedAdamState
from jax_dos.core.trees import decay_flags, is_nnx_variable, leaves_with_paths
from jax_dos.memory import host_ram, pinned_pool
from jax_dos.memory import kinds as memory
from jax_dos.optimizer import traced
from jax_dos.optimizer.engine import Engine
from jax_dos.planning import host_plan
from jax_dos.planning.plan import (
  MEMORY_KIND,
  Plan,
  PlanSpec,
  agreed_across_processes,
  check_subgroup_size,
  resolve_plan,
)

Planner = Callable[[Any, int], Plan]  # (params, subgroup_size) -> Plan
DELAY_PREDICTIONS = ("moments", "gradient")


class TracedUpdateWarning(UserWarning):
  """An ``interleaved_adam`` update with offloaded state was traced (inside ``jit``): it runs the slow path.

  Said once per optimizer. The traced path moves every offloaded leaf's state to the accelerator and back inside
  the program, unpipelined, with no host kernel; the plan was made for the eager engine. Call the update outside
  ``jit`` (``tx.update``, ``jax_dos.update_params``, ``nnx.Optimizer.update`` outside ``nnx.jit``) after a jitted
  gradient step, or, where tracing is meant, filter it:
  ``warnings.filterwarnings("ignore", category=jax_dos.TracedUpdateWarning)``.
  """


# Set while jax_dos itself traces an update only for its output's shapes (jax_dos.multi_steps's skipped calls):
# that runs nothing, so it warns of nothing.
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("jax_dos_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
  """Within it, a traced ``update`` is taken to be traced for shapes only (no :class:`TracedUpdateWarning`)."""
  token = _SHAPES_ONLY.set(True)
  try:
    yield
  finally:
    _SHAPES_ONLY.reset(token)


def _deleted(xs: list) -> bool:
  return any(isinstance(x, jax.Array) and x.is_deleted() for x in xs)


def _check_not_consumed(state_leaves: list, param_leaves: list, grads: list) -> None:
  """A clear error, before any work, for arrays an earlier eager update consumed (donated or released)."""
  if _deleted(state_leaves):
    raise ValueError(
      "this optimizer state was already consumed by an earlier update (its buffers were donated to it or released"
      " when copied). Pass the state returned by the latest update."
    )
  if _deleted(param_leaves):
    raise ValueError(
      "these params were already consumed by an earlier jax_dos.update_params (their buffers hold the new"
      " parameters). Pass the params it returned."
    )
  if _deleted(grads):
    raise ValueError("some gradients were deleted or donated before this update; pass live arrays.")


# Set by find_interleaved while it traces a combined transformation's init: the optimizers met are recorded there.
_FOUND: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("jax_dos_found", default=None)


class InterleavedAdam:
  """The optimizer of one ``interleaved_adam`` transformation: its options, and a plan and an engine per tree.

  Every option is ``jax_dos.interleaved_adam``'s and is given explicitly (the
  defaults live there alone). ``planner`` is called for ``plan="auto"``.
  """

  def __init__(
    self,
    hyper: AdamHyper,
    *,
    mask: Any,
    subgroup_size: int,
    plan: PlanSpec,
    planner: Optional[Planner],
    delay: int,
    delay_warmup: int,
    delay_predict: Union[bool, str, None],
    write_behind: bool,
    partition_replicated: Union[bool, str],
    host_memory: Optional[host_plan.HostMemory] = None,
  ):
    check_subgroup_size(subgroup_size)
    if not (isinstance(partition_replicated, bool) or partition_replicated == "auto"):
      raise ValueError(
        f"partition_replicated must be 'auto' (partition replicated parameters' state over the mesh), False (a"
        f" whole copy per device) or True, got {partition_replicated!r}."
      )
    delay_predict = prediction_mode(delay_predict)
    if delay not in (0, 1) or isinstance(delay, bool):
      raise ValueError(f"delay must be 0 (off) or 1 (host subgroups update one step late), got {delay!r}.")
    if write_behind and delay:
      raise ValueError(
        "write_behind=True keeps optax's numbers and hides part of the host update; delay=1 hides all of it one"
        " step late. Pick one."
      )
    if delay_predict and not delay:
      raise ValueError(
        f"delay_predict={delay_predict!r} predicts the parameters a delayed update hands on: it needs delay=1."
      )
    if hyper.moments != "float32" and delay_predict:
      raise ValueError(
        f"delay_predict={delay_predict!r} sends or predicts from float32 moments; with moments={hyper.moments!r} use"
        " delay_predict=False (the plain delay) or moments='float32'."
      )
    if isinstance(delay_warmup, bool) or not isinstance(delay_warmup, (int, np.integer)) or delay_warmup < 0:
      raise ValueError(f"delay_warmup must be an integer >= 0 (normal steps before the delay), got {delay_warmup!r}.")
    self.hyper, self.mask, self.subgroup_size, self.plan_spec, self.planner = hyper, mask, subgroup_size, plan, planner
    self.delay, self.delay_warmup, self.delay_predict = int(delay), int(delay_warmup), delay_predict
    self.write_behind = bool(write_behind)
    self.partition_replicated = partition_replicated
    self.host_memory = host_memory  # None: this machine's (host_plan.HostMemory.here())
    self._plans: dict[Any, Plan] = {}
    self._engines: dict[Any, Engine] = {}
    self._warned_traced = False  # TracedUpdateWarning said (once per optimizer)

  @property
  def partitions(self) -> bool:
    """Whether replicated parameters get partitioned state (``"auto"`` or ``True``; a no-op on one device)."""
    return self.partition_replicated is not False

  def plan_for(self, params: Any) -> Plan:
    """The :class:`Plan` for ``params`` (made once per tree structure, shapes and dtypes)."""
    leaves = jax.tree.leaves(params)
    # NNX variables are leaves here: nnx.state(model, nnx.Param) (at init) and its pure arrays (what nnx.Optimizer
    # passes to update) share a plan, which a second planning could change (free accelerator memory has changed).
    treedef = jax.tree.structure(params, is_leaf=is_nnx_variable)
    key = (treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
    if key not in self._plans:
      if isinstance(self.plan_spec, str) and self.plan_spec == "auto":
        if self.planner is None:
          raise ValueError("plan='auto' needs a planner: pass planner=jax_dos.auto_planner() (interleaved_adam does).")
        planned = partition.state_layout(params) if self.partitions else params
        relaid = [(s, p) for s, p in zip(jax.tree.leaves(planned), leaves) if s is not p]
        extra = {}
        if relaid and getattr(self.planner, "counts_relayout", False):  # what the update holds to gather them
          extra["relayout_elements"] = tuple(sum(memory.device_elements(x[k]) for x in relaid) for k in (0, 1))
        plan = agreed_across_processes(self.planner(planned, self.subgroup_size, **extra))
        if (self.delay or self.write_behind) and plan.indices("stream"):
          # Delayed (or written-behind) host work overlaps the next forward/backward pass, streamed work does not:
          # stream nothing.
          placements = [p if p != "stream" else "host" for p in plan.placements]
          source = "model+delay" if self.delay else "model+write_behind"
          plan = plan.with_placements(placements, source=source, predicted={})
        self._plans[key] = plan
      else:
        self._plans[key] = resolve_plan(self.plan_spec, params, self.subgroup_size)
      self._check_host(self._plans[key], params)
    return self._plans[key]

  def _check_host(self, plan: Plan, params: Any) -> None:
    """Refuses a plan whose pinned state does not fit its host's RAM (``host_plan.py``), from shapes, before
    anything is allocated. For a tree laid out over every process the refusal is agreed (a collective): plans agree
    across processes, so every process takes it or none does.
    """
    if all(p == "device" for p in plan.placements):
      return
    leaves = jax.tree.leaves(partition.state_layout(params) if self.partitions else params)
    copies = (self.delay and self.delay_predict == "moments") or self.write_behind
    moments = bool(self.delay) and self.delay_predict == "gradient"
    spans = host_plan.spans_processes(leaves)  # else this process's own tree (the calibration's): no collective
    host = self.host_memory if self.host_memory is not None else host_plan.HostMemory.here(count_processes=spans)
    layout = host_plan.host_plan(leaves, plan.leaf_placements(), host, bool(copies), moments, self.hyper.moments)
    host_plan.check(layout, agree=spans)

  def init(self, params: optax.Params) -> InterleavedAdamState:
    """Master weights (float32 copies of ``params``) and zero moments, each leaf in its plan's memory kind."""
    found = _FOUND.get()
    if found is not None:  # find_interleaved is tracing a combined transformation: say who is here, plan nothing
      found.append(self)
      zero = jnp.zeros([], jnp.int32)
      return InterleavedAdamState(zero, params, params, params)
    leaves, treedef = leaves_with_paths(params, "params")
    plan = self.plan_for(params)
    kinds = plan.leaf_memory_kinds()
    if self.partitions:  # each device's state: its share of the leaves replicated over mesh axes
      leaves = partition.relaid(leaves, jax.tree.leaves(partition.state_layout(params)))
    if not any(memory.is_traced(x) for x in leaves):
      copies = (self.delay and self.delay_predict == "moments") or self.write_behind
      moments = bool(self.delay) and self.delay_predict == "gradient"
      need = host_state_bytes(plan, leaves, copies, moments, self.hyper.moments)  # this process's
      # Global arrays: every process of the job calls init, and the host's RAM holds all of theirs (a collective).
      shared = any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves)
      try:
        pinned_pool.check_host_capacity(need, on_host=host_ram.bytes_on_this_host(need) if shared else None)
        refusal = None
      except MemoryError as e:
        refusal = str(e)
      refusal = host_plan.agreed_refusal(refusal) if shared else refusal  # all processes refuse, or none
      if refusal is not None:
        raise MemoryError(refusal)
    master = [memory.copy_in(x, k) for x, k in zip(leaves, kinds)]
    fmt = self.hyper.moments
    mu = [moment_formats.zero_moment_like(x, k, fmt) for x, k in zip(leaves, kinds)]
    nu = [moment_formats.zero_moment_like(x, k, fmt) for x, k in zip(leaves, kinds)]
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
    return InterleavedAdamState(jnp.zeros([], jnp.int32), unflat(master), unflat(mu), unflat(nu))

  def update(
    self,
    updates: optax.Updates,
    state: InterleavedAdamState,
    params: Optional[optax.Params] = None,
    *,
    grad_scale: Any = None,
    **extra_args,
  ):
    """optax's ``update``: ``(updates, new_state)``, with ``s * updates`` as the gradients for ``grad_scale=s``."""
    del extra_args  # optax's convention: a transformation ignores extra arguments it does not take
    return self._step(updates, state, params, grad_scale, new_params=False)

  def update_params(self, grads: optax.Updates, state: InterleavedAdamState, params: optax.Params, grad_scale: Any):
    """``(new_params, new_state)``: see ``jax_dos.update_params``."""
    return self._step(grads, state, params, grad_scale, new_params=True)

  def _step(self, updates, state, params, grad_scale, new_params: bool):
    if params is None:
      raise ValueError("interleaved_adam.update needs params (like optax.adamw): call tx.update(grads, state, params).")
    if not isinstance(state, InterleavedAdamState):
      raise TypeError(
        f"expected an InterleavedAdamState, got {type(state).__name__}; pass the state made by this optimizer's init."
      )
    grads, gdef = leaves_with_paths(updates, "gradient")
    sdef = jax.tree.structure(state.master)
    if gdef != sdef:
      raise ValueError(f"gradient tree does not match the optimizer state.\n  gradients: {gdef}\n  state:     {sdef}")
    param_leaves, pdef = leaves_with_paths(params, "params")
    if pdef != sdef:
      raise ValueError(f"params tree does not match the optimizer state.\n  params: {pdef}\n  state:  {sdef}")
    for g, p, path in zip(grads, param_leaves, jax.tree_util.tree_flatten_with_path(params)[0]):
      if np.shape(g) != np.shape(p):
        raise ValueError(
          f"gradient for {jax.tree_util.keystr(path[0])} has shape {np.shape(g)}, params have {np.shape(p)}."
        )
    grad_scale = _check_grad_scale(grad_scale)
    self._check_moments(state)
    plan = self.plan_for(params)
    decay = decay_flags(self.mask, params, self.hyper.weight_decay)
    masters, mus, nus = (jax.tree.leaves(t) for t in (state.master, state.mu, state.nu))
    args = (grads, masters, mus, nus, param_leaves)
    if any(memory.is_traced(x) for x in (*grads, *masters, *param_leaves, state.count, grad_scale)):
      self._warn_traced(plan)
      out = traced.update_leaves(
        *args, state.count, plan.leaf_placements(), decay, self.hyper, self.delay, self.delay_warmup, grad_scale,
        new_params, self.delay_predict,
      )  # fmt: skip
    else:
      _check_not_consumed(masters + mus + nus + [state.count], param_leaves, grads)
      # State laid out otherwise than its parameters (partitioned): the engine works on the state's shards, and
      # the new parameters (or updates) go back to the parameters' layout.
      engine_params = partition.relaid(param_leaves, masters)
      if new_params:  # consumed: a replicated parameter's slice is what the update reads, and its gathered new
        for old, mine in zip(param_leaves, engine_params):  # weights take the old ones' place (budgets.py's R)
          if mine is not old:
            old.delete()
      args = (grads, masters, mus, nus, engine_params)
      out = self._engine(plan, decay).update(*args, state.count, grad_scale, new_params)
      if any(a is not b for a, b in zip(engine_params, param_leaves)):
        out = (partition.relaid(out[0], param_leaves), *out[1:])
    u, m32, m1, m2, count = out
    unflat = lambda xs: jax.tree.unflatten(sdef, xs)  # noqa: E731
    return unflat(u), InterleavedAdamState(count, unflat(m32), unflat(m1), unflat(m2))

  def _warn_traced(self, plan: Plan) -> None:
    """One :class:`TracedUpdateWarning` per optimizer, the first time an update of offloaded state is traced.

    Any offloaded subgroup (``"stream"`` or ``"host"``), not only host ones: both are what the engine pipelines
    (streamed ones through a few staging slots, host ones with the host kernel), and traced, each one's whole
    state crosses PCIe twice inside the program, unpipelined and held on the accelerator, memory no plan budgeted.
    An all-``"device"`` plan traces to what the engine runs anyway: no warning.
    """
    offloaded = [p for p in plan.placements if p != "device"]
    if self._warned_traced or not offloaded or _SHAPES_ONLY.get():
      return
    self._warned_traced = True
    warnings.warn(
      f"interleaved_adam's update is being traced (inside jax.jit, nnx.jit or another JAX transformation) with"
      f" {len(offloaded)} of {len(plan.placements)} subgroups offloaded ({', '.join(sorted(set(offloaded)))}): it"
      " runs the traced path, which copies their whole state to the accelerator and back inside the program, with no"
      " host kernel and no pipelining, not the eager engine the plan is made for. Call the update outside jit: jit"
      " the gradient step only, then tx.update(grads, opt_state, params) or jax_dos.update_params(tx, grads,"
      " opt_state, params) eagerly (with Flax NNX: nnx.Optimizer.update outside nnx.jit; docs/api.md, 'Flax NNX')."
      " Said once per optimizer; filter jax_dos.TracedUpdateWarning if tracing is intended.",
      TracedUpdateWarning,
      stacklevel=4,
    )

  def _check_moments(self, state: InterleavedAdamState) -> None:
    want = moment_formats.stored_dtype(self.hyper.moments)
    found = {jnp.result_type(x) for x in jax.tree.leaves((state.mu, state.nu))}
    if found - {want}:
      raise ValueError(
        f"this optimizer stores its moments as {self.hyper.moments!r} ({want}), but the state's are"
        f" {sorted(map(str, found))}. Pass the state this optimizer's init made, or restore a checkpoint through"
        " jax_dos.CheckpointManager into tx.init(params), which converts between formats."
      )

  def _engine(self, plan: Plan, decay: tuple[bool, ...]) -> Engine:
    key = (plan, decay)
    if key not in self._engines:
      self._engines[key] = Engine(
        self.hyper, plan, decay, self.delay, self.delay_warmup, self.delay_predict, self.write_behind
      )
    return self._engines[key]


def prediction_mode(delay_predict: Union[bool, str, None]) -> Optional[str]:
  """``delay_predict`` as ``None``, ``"moments"`` (``True``) or ``"gradient"``."""
  if delay_predict is None or delay_predict is False:
    return None
  if delay_predict is True:
    return "moments"
  if isinstance(delay_predict, str) and delay_predict in DELAY_PREDICTIONS:
    return delay_predict
  raise ValueError(
    f"delay_predict must be False, True (= 'moments') or one of {DELAY_PREDICTIONS}, got {delay_predict!r}."
  )


def _check_grad_scale(grad_scale: Any) -> Any:
  if grad_scale is None:
    return 1.0
  try:
    dtype = jnp.result_type(grad_scale)
    real = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  except TypeError:
    real = False
  if not real or np.shape(grad_scale) != ():
    raise ValueError(
      f"grad_scale must be a real scalar (a float or a 0-d array) multiplying every gradient, got"
      f" {type(grad_scale).__name__} of shape {np.shape(grad_scale)}. For a global-norm clip pass"
      " jax_dos.clip_scale(optax.global_norm(grads), max_norm)."
    )
  return grad_scale


def host_state_bytes(
  plan: Plan, leaves: list[Any], float32_copies: bool = False, moment_copies: bool = False, moments: str = "float32"
) -> int:
  """Pinned host bytes a plan needs in this process: 12 B per offloaded parameter (master, mu, nu; 8 with bfloat16
  moments, about 6 with int8: ``moment_formats.state_bytes_per_param``), 4 more per host-updated one, counted over
  this process's devices (a leaf replicated over them costs a copy each).

  The 4 are its gradient (float32), or its bfloat16 gradient and the engine's bfloat16 copy of its new weight.
  With ``float32_copies`` (``delay_predict="moments"``, ``write_behind``), float32 parameters' host copies add 4
  more; with ``moment_copies`` (``delay_predict="gradient"``), bfloat16 ones' copies of mu and nu add 4.
  """
  placements = plan.leaf_placements()
  size = memory.process_elements
  per_param = moment_formats.state_bytes_per_param(moments)
  state = sum(per_param * size(x) for x, p in zip(leaves, placements) if MEMORY_KIND[p] == "pinned_host")

  def extra(x):
    bf16 = jnp.result_type(x) == jnp.bfloat16
    return 4 + (4 if float32_copies and not bf16 else 0) + (4 if moment_copies and bf16 else 0)

  return int(state) + sum(extra(x) * size(x) for x, p in zip(leaves, placements) if p == "host")


class InterleavedAdamTransformation(optax.GradientTransformationExtraArgs):
  """The ``optax.GradientTransformationExtraArgs`` that ``interleaved_adam`` returns, with its optimizer.

  ``init`` and ``update`` are optax's; ``interleaved`` is the
  :class:`InterleavedAdam` behind them (its hyperparameters, plans and engines).
  """

  interleaved: InterleavedAdam

  @classmethod
  def of(cls, opt: InterleavedAdam) -> InterleavedAdamTransformation:
    tx = cls(opt.init, opt.update)
    tx.interleaved = opt
    return tx


def find_interleaved(tx: optax.GradientTransformation, params: Any, what: str) -> tuple[InterleavedAdam, bool]:
  """The :class:`InterleavedAdam` of ``tx``, and whether ``tx`` is its own transformation (not a combination).

  ``tx`` is the transformation ``interleaved_adam`` returned (``tx.interleaved``),
  or one combining it with others: ``optax.chain``, ``jax_dos.multi_steps``, any
  transformation whose ``init`` calls its members' ``init``. Those are found by
  tracing ``tx.init`` abstractly on ``params`` (nothing is allocated or
  planned); exactly one ``interleaved_adam`` must be among them. ``what`` names
  the caller in errors.
  """
  own = getattr(tx, "interleaved", None)
  if isinstance(own, InterleavedAdam):
    return own, True
  if not callable(getattr(tx, "init", None)):
    raise TypeError(f"{what} takes an optax transformation containing jax_dos.interleaved_adam, got {tx!r}.")
  found: list[InterleavedAdam] = []
  token = _FOUND.set(found)
  try:
    jax.eval_shape(lambda p: tx.init(p), params)  # a fresh function each time: jax caches traces per function
  finally:
    _FOUND.reset(token)
  distinct = list({id(opt): opt for opt in found}.values())
  if len(distinct) != 1:
    raise TypeError(
      f"{what} takes a transformation containing exactly one jax_dos.interleaved_adam (alone, or in an optax.chain"
      f" or jax_dos.multi_steps), found {len(distinct)}."
    )
  return distinct[0], False
