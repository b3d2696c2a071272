"""``interleaved_adam``: optax's AdamW with its state offloaded to host memory.

Drop-in for ``optax.adamw``: same hyperparameters, same numbers. The state is
a pytree of ordinary ``jax.Array`` s mirroring the parameters (fp32 master
weights, mu, nu) plus a step count; each leaf lives in ``pinned_host`` or
``device`` memory according to the plan (see ``plan.py``).

``update`` runs one of two ways, with the same arithmetic:

* **traced** (called inside ``jax.jit``, or under ``optax.MultiSteps`` whose
  ``lax.cond`` traces it): pure XLA with in-jit ``device_put`` (``traced.py``);
* **eager** (called on concrete arrays): the engine (``engine.py``), which
  pipelines streamed subgroups and runs the host kernel concurrently. This is
  the fast path; it consumes ``state`` like a donated argument.

Gradient flush: jit the gradient function with
``out_shardings=gradient_shardings(tx, params)`` (for its gradient output):
XLA then writes the gradients of host subgroups to ``pinned_host`` memory
itself, copying each one out of the accelerator inside the backward pass, and
the engine finds them on the host already (float32 or bfloat16, which the
host kernel reads as they are).

Gradient accumulation on the fast path: accumulate in the jitted gradient
step and call ``update`` eagerly every ``k`` micro-batches (see README), since
``optax.MultiSteps`` always traces its inner update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_dos import memory, traced
from jax_dos.adam_math import AdamHyper, ScalarOrSchedule
from jax_dos.engine import Engine
from jax_dos.plan import MEMORY_KIND, Plan, PlanSpec, check_subgroup_size, resolve_plan
from jax_dos.planning.search import auto_planner

DEFAULT_SUBGROUP_SIZE = 64 * 2**20  # 256 MiB of fp32 per state array; see docs/design.md


class InterleavedAdamState(NamedTuple):
  """State of :func:`interleaved_adam`: trees mirroring the parameters."""

  count: jax.Array  # int32 scalar: steps taken
  master: optax.Params  # fp32 master weights
  mu: optax.Updates  # first moment, fp32
  nu: optax.Updates  # second moment, fp32


def _leaves_with_paths(tree: Any, what: str) -> tuple[list[Any], Any]:
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, leaf in path_leaves:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"interleaved_adam: {what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; every leaf must be a"
        " floating-point array. Keep integer buffers out of the optimized tree (e.g. with optax.masked or a"
        " flax.nnx filter)."
      )
    leaves.append(leaf)
  return leaves, treedef


def _decay_flags(mask, params, weight_decay: float) -> tuple[bool, ...]:
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


class _InterleavedAdam:
  """Holds the hyperparameters and caches a plan and an engine per tree signature."""

  def __init__(
    self,
    hyper: AdamHyper,
    mask,
    subgroup_size: int,
    plan: PlanSpec,
    planner: Optional[Callable],
    delay: int = 0,
    delay_warmup: int = 0,
    delay_predict: Union[bool, str] = False,
    write_behind: bool = False,
  ):
    check_subgroup_size(subgroup_size)
    delay_predict = _prediction_mode(delay_predict)
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
    if isinstance(delay_warmup, bool) or not isinstance(delay_warmup, (int, np.integer)) or delay_warmup < 0:
      raise ValueError(f"delay_warmup must be an integer >= 0 (normal steps before the delay), got {delay_warmup!r}.")
    self.hyper, self.mask, self.subgroup_size, self.plan_spec, self.planner = hyper, mask, subgroup_size, plan, planner
    self.delay, self.delay_warmup, self.delay_predict = int(delay), int(delay_warmup), delay_predict
    self.write_behind = bool(write_behind)
    self._plans: dict[Any, Plan] = {}
    self._engines: dict[Any, Engine] = {}

  def plan_for(self, params: Any) -> Plan:
    leaves, treedef = jax.tree.flatten(params)
    key = (treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
    if key not in self._plans:
      if isinstance(self.plan_spec, str) and self.plan_spec == "auto":
        if self.planner is None:
          self.planner = auto_planner(ahead_copies=self.delay_predict == "gradient")
        plan = self.planner(params, self.subgroup_size)
        if (self.delay or self.write_behind) and plan.indices("stream"):
          # Delayed (or written-behind) host work overlaps the next forward/backward pass, streamed work does not:
          # stream nothing.
          placements = [p if p != "stream" else "host" for p in plan.placements]
          source = "model+delay" if self.delay else "model+write_behind"
          plan = plan.with_placements(placements, source=source, predicted={})
        self._plans[key] = plan
      else:
        self._plans[key] = resolve_plan(self.plan_spec, params, self.subgroup_size)
    return self._plans[key]

  def init(self, params: optax.Params) -> InterleavedAdamState:
    leaves, treedef = _leaves_with_paths(params, "params")
    plan = self.plan_for(params)
    kinds = [MEMORY_KIND[p] for p in plan.leaf_placements()]
    if not any(memory.is_traced(x) for x in leaves):
      copies = (self.delay and self.delay_predict == "moments") or self.write_behind
      moments = bool(self.delay) and self.delay_predict == "gradient"
      memory.check_host_capacity(host_state_bytes(plan, leaves, copies, moments))
    master = [memory.copy_in(x, k) for x, k in zip(leaves, kinds)]
    mu = [memory.zeros_like_in(x, k) for x, k in zip(leaves, kinds)]
    nu = [memory.zeros_like_in(x, k) for x, k in zip(leaves, kinds)]
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
    del extra_args  # optax's convention: a transformation ignores extra arguments it does not take
    return self._step(updates, state, params, grad_scale, new_params=False)

  def update_params(self, grads: optax.Updates, state: InterleavedAdamState, params: optax.Params, grad_scale: Any):
    """``(new_params, new_state)``: see :func:`update_params`."""
    return self._step(grads, state, params, grad_scale, new_params=True)

  def _step(self, updates, state, params, grad_scale, new_params: bool):
    if params is None:
      raise ValueError("interleaved_adam.update needs params (like optax.adamw): call tx.update(grads, state, params).")
    if not isinstance(state, InterleavedAdamState):
      raise TypeError(
        f"expected an InterleavedAdamState, got {type(state).__name__}; pass the state made by this optimizer's init."
      )
    grads, gdef = _leaves_with_paths(updates, "gradient")
    sdef = jax.tree.structure(state.master)
    if gdef != sdef:
      raise ValueError(f"gradient tree does not match the optimizer state.\n  gradients: {gdef}\n  state:     {sdef}")
    param_leaves, pdef = _leaves_with_paths(params, "params")
    if pdef != sdef:
      raise ValueError(f"params tree does not match the optimizer state.\n  params: {pdef}\n  state:  {sdef}")
    for g, p, path in zip(grads, param_leaves, jax.tree_util.tree_flatten_with_path(params)[0]):
      if np.shape(g) != np.shape(p):
        raise ValueError(
          f"gradient for {jax.tree_util.keystr(path[0])} has shape {np.shape(g)}, params have {np.shape(p)}."
        )
    grad_scale = _check_grad_scale(grad_scale)
    plan = self.plan_for(params)
    decay = _decay_flags(self.mask, params, self.hyper.weight_decay)
    masters, mus, nus = (jax.tree.leaves(t) for t in (state.master, state.mu, state.nu))
    args = (grads, masters, mus, nus, param_leaves)
    if any(memory.is_traced(x) for x in (*grads, *masters, *param_leaves, state.count, grad_scale)):
      out = traced.update_leaves(
        *args, state.count, plan.leaf_placements(), decay, self.hyper, self.delay, self.delay_warmup, grad_scale,
        new_params, self.delay_predict,
      )  # fmt: skip
    else:
      out = self._engine(plan, decay).update(*args, state.count, grad_scale, new_params)
    u, m32, m1, m2, count = out
    unflat = lambda xs: jax.tree.unflatten(sdef, xs)  # noqa: E731
    return unflat(u), InterleavedAdamState(count, unflat(m32), unflat(m1), unflat(m2))

  def _engine(self, plan: Plan, decay: tuple[bool, ...]) -> Engine:
    key = (plan, decay)
    if key not in self._engines:
      self._engines[key] = Engine(
        self.hyper, plan, decay, self.delay, self.delay_warmup, self.delay_predict, self.write_behind
      )
    return self._engines[key]


DELAY_PREDICTIONS = ("moments", "gradient")


def _prediction_mode(delay_predict: Union[bool, str, None]) -> Optional[str]:
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


def host_state_bytes(plan: Plan, leaves: list[Any], float32_copies: bool = False, moment_copies: bool = False) -> int:
  """Pinned host bytes a plan needs: 12 B per offloaded parameter (master, mu, nu), 4 more per host-updated one.

  The 4 are its gradient (float32), or its bfloat16 gradient and the engine's bfloat16 copy of its new weight.
  With ``float32_copies`` (``delay_predict="moments"``, ``write_behind``), float32 parameters' host copies add 4
  more; with ``moment_copies`` (``delay_predict="gradient"``), bfloat16 ones' copies of mu and nu add 4.
  """
  placements = plan.leaf_placements()
  size = lambda x: int(np.prod(np.shape(x)))  # noqa: E731
  state = sum(12 * size(x) for x, p in zip(leaves, placements) if MEMORY_KIND[p] == "pinned_host")

  def extra(x):
    bf16 = jnp.result_type(x) == jnp.bfloat16
    return 4 + (4 if float32_copies and not bf16 else 0) + (4 if moment_copies and bf16 else 0)

  return state + sum(extra(x) * size(x) for x, p in zip(leaves, placements) if p == "host")


def interleaved_adam(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  weight_decay: float = 0.0,
  mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
  *,
  subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
  plan: PlanSpec = "auto",
  planner: Optional[Callable[[Any, int], Plan]] = None,
  delay: int = 0,
  delay_warmup: int = 10,
  delay_predict: Union[bool, str] = False,
  write_behind: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW whose fp32 master weights and moments live in host memory.

  The maths is exactly ``optax.adamw``'s (see ``adam_math.py``)::

      m_t = b1 m_{t-1} + (1 - b1) g_t          v_t = b2 v_{t-1} + (1 - b2) g_t^2
      u_t = -lr_t ( m_t / (1 - b1^t) / (sqrt(v_t / (1 - b2^t) + eps_root) + eps) + wd p_{t-1} )

  with ``wd`` applied where ``mask`` is True. The update returned makes
  ``optax.apply_updates(params, updates)`` equal the new fp32 master cast to
  each parameter's dtype. Non-finite gradients propagate exactly as in optax.

  Args:
    learning_rate: a float or an optax schedule ``count -> lr``.
    b1, b2, eps, eps_root: as in ``optax.adam``.
    weight_decay: decoupled weight decay (``optax.adamw``'s ``weight_decay``).
    mask: tree of bools (or a function of params returning one, or a prefix of
      the params tree) saying which leaves get weight decay.
    subgroup_size: leaves are packed into subgroups of at most this many
      elements (a larger leaf is a subgroup of its own).
    plan: ``"auto"``, one of ``"device" | "stream" | "host"`` for every
      subgroup, a sequence with one placement per subgroup, or a ``jax_dos.Plan``.
    planner: function ``(params, subgroup_size) -> Plan`` used by ``"auto"``;
      defaults to the performance model, ``jax_dos.auto_planner()``, which
      calibrates this machine once (cached) and fills the resident budget
      from free accelerator memory. Pass ``jax_dos.auto_planner(
      resident_budget_bytes=..., staging_budget_bytes=...)`` to set budgets.
    delay: ``1`` updates host subgroups one step late (ZeRO-Offload's delayed
      parameter update), so that the host kernel of step ``t`` runs while the
      accelerator computes step ``t + 1``: from step ``delay_warmup`` on, the
      update returned at step ``t`` takes host subgroups' parameters to their
      masters after step ``t - 1``, and step ``t + 1``'s gradients are taken at
      those parameters. Moments and masters follow Adam exactly on the
      gradients they are given. ``0`` (default) is optax's AdamW. With
      ``plan="auto"``, subgroups the model would stream are host-updated
      instead, since only host work is hidden behind the next step.
    delay_warmup: normal steps before the delay starts (default 10).
    delay_predict: with ``delay=1``, what the forward pass of step ``t + 1``
      gets for host subgroups instead of the stale masters of step ``t - 1``
      (moments and masters still follow Adam exactly on the gradients they
      are given, on the host):

      - ``"moments"`` (or ``True``): a prediction of step ``t``'s masters, one
        more AdamW step that leaves the moments as they are, ``p - lr_t (m /
        (1 - b1^t') / (sqrt(v / (1 - b2^t') + eps_root) + eps) + wd p)``
        (``adam_math.predict_next``; ``t'`` the step's bias-correction count),
        written by the host kernel in the same pass: no accelerator memory,
        4 B of host memory per float32 parameter. Recovers most, not all, of
        what the plain delay loses in convergence.
      - ``"gradient"``: step ``t``'s masters themselves. The host sends copies
        of master, mu and nu after step ``t - 1`` (in the parameters' dtype)
        to the accelerator during step ``t``'s forward/backward pass, and
        ``update`` takes step ``t``'s AdamW step there with step ``t``'s
        gradients: the trajectory of undelayed AdamW (float32 parameters:
        the same numbers to float32 rounding; bfloat16: ``cast(master)`` up
        to the copies' rounding, mostly equal), while the exact float32
        step still runs on the host, hidden behind the next forward/backward
        pass. Copies are sent ahead (held through that pass: 3 x the
        parameter's bytes per host-updated parameter) for the host subgroups
        that fit in the memory the plan leaves free (``Plan.ahead_budget_bytes``;
        give your own planner ``auto_planner(ahead_copies=True)``), and in
        ``update`` for the others: their PCIe time (6 B for a bfloat16
        parameter: the kernel writes bfloat16 copies of mu and nu in the same
        pass, 4 B of host memory) is then part of the step, as is the
        gradients' return to the accelerator if they were flushed to the host.

      Stale momentum is what makes the plain delay converge worse (docs/design.md, BENCHMARKS.md).
    write_behind: keep optax's numbers exactly and hide part of the host
      update: the host kernel first computes each host subgroup's new weights
      without storing master, mu and nu (16 of its 28 bytes a parameter),
      ``update`` returns once those are sent, and a second pass writes the
      state in the background during the caller's next forward/backward
      pass (the next ``update`` and ``wait_for_host_updates`` wait for it).
      With ``plan="auto"`` streamed subgroups become host ones. Not with ``delay``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``update`` requires
    ``params``. Eagerly (outside ``jit``) it consumes ``state`` in place; inside
    ``jit`` it is pure. ``update(grads, state, params, grad_scale=s)`` takes
    ``s * grads`` as the gradients (a scalar, on any device); with
    ``s = jax_dos.clip_scale(optax.global_norm(grads), max_norm)`` that is
    ``optax.chain(optax.clip_by_global_norm(max_norm), adamw)`` without
    rescaling the gradients on the accelerator first, which lets XLA flush
    host subgroups' gradients during the backward pass (see ``docs/design.md``).
  """
  hyper = AdamHyper(learning_rate, b1, b2, eps, eps_root, weight_decay)
  opt = _InterleavedAdam(hyper, mask, subgroup_size, plan, planner, delay, delay_warmup, delay_predict, write_behind)
  tx = optax.GradientTransformationExtraArgs(opt.init, opt.update)
  return tx


def interleaved_adamw(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  weight_decay: float = 1e-4,
  mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
  **kwargs,
) -> optax.GradientTransformationExtraArgs:
  """:func:`interleaved_adam` with ``optax.adamw``'s default ``weight_decay=1e-4``."""
  return interleaved_adam(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, **kwargs)


def _owner(tx: optax.GradientTransformation, what: str) -> _InterleavedAdam:
  owner = getattr(tx.update, "__self__", None)
  if not isinstance(owner, _InterleavedAdam):
    raise TypeError(f"{what} takes the transformation returned by jax_dos.interleaved_adam (not a chain of it).")
  return owner


def update_params(
  tx: optax.GradientTransformation,
  grads: optax.Updates,
  state: InterleavedAdamState,
  params: optax.Params,
  *,
  grad_scale: Any = None,
) -> tuple[optax.Params, InterleavedAdamState]:
  """One step returning the new parameters: ``tx.update`` and ``optax.apply_updates`` in one.

  For an ``interleaved_adam`` transformation ``tx``::

      params, state = jax_dos.update_params(tx, grads, state, params, grad_scale=s)

  gives the parameters of::

      updates, state = tx.update(grads, state, params, grad_scale=s)
      params = optax.apply_updates(params, updates)

  namely each leaf's new fp32 master cast to the parameter's dtype (with
  ``delay=1``, host subgroups' delayed masters), without ever holding an
  update tree: that tree is float32 whatever the parameters' dtype, 4 bytes a
  parameter (27 GB at 6.7B) the accelerator can give to resident state
  instead (tell the planner: ``auto_planner(params_in_place=True)``).
  Eagerly it consumes ``params`` and ``state`` like donated arguments; inside
  ``jit`` it is pure.
  """
  return _owner(tx, "update_params").update_params(grads, state, params, grad_scale)


def get_plan(tx: optax.GradientTransformation, params: Any) -> Plan:
  """The :class:`Plan` an ``interleaved_adam`` transformation uses for ``params``."""
  return _owner(tx, "get_plan").plan_for(params)


GRADIENT_FLUSHES = ("host", "all")


def gradient_memory_kinds(tx: optax.GradientTransformation, params: Any, flush: str = "host") -> Any:
  """A tree like ``params`` naming the memory each gradient should come out of the backward pass in.

  ``flush="host"``: ``"pinned_host"`` for leaves of host subgroups, ``"device"``
  for the others. ``flush="all"``: ``"pinned_host"`` for every leaf; the
  update then copies resident and streamed subgroups' gradients back to the
  accelerator (their bytes cross PCIe twice). Use it when the backward pass
  cannot afford gradients on the accelerator (6.7B GPT: 18.2 GiB of
  temporaries and no gradients on it, against 7.0 GiB plus 12.4 GiB of
  gradients unflushed). With ``"host"``, a plan that splits the gradients
  between memories can make XLA keep far more (47 GiB at 6.7B,
  ``bench/probes/flush_probe.py``); compile the step and check its memory.

  Empty leaves stay on the device: nothing to move, and jax 0.11 reports a
  zero-size output of ``pinned_host`` sharding as device memory.
  """
  if flush not in GRADIENT_FLUSHES:
    raise ValueError(f"flush must be one of {GRADIENT_FLUSHES}, got {flush!r}.")
  plan = _owner(tx, "gradient_memory_kinds").plan_for(params)
  leaves = jax.tree.leaves(params)
  kinds = [
    "pinned_host" if (flush == "all" or p == "host") and np.size(x) else "device"
    for p, x in zip(plan.leaf_placements(), leaves)
  ]
  return jax.tree.unflatten(jax.tree.structure(params), kinds)


def gradient_shardings(tx: optax.GradientTransformation, params: Any, flush: str = "host") -> Any:
  """Output shardings for a jitted gradient function: each parameter's sharding, in the memory it is flushed to.

  The memory is :func:`gradient_memory_kinds`'s: host memory for host
  subgroups' gradients (for every gradient with ``flush="all"``).

  Use as the gradients' part of ``jax.jit(..., out_shardings=...)``::

      grad_fn = jax.jit(jax.value_and_grad(loss), out_shardings=(None, jax_dos.gradient_shardings(tx, params)))

  Gradients must be float32 or bfloat16 (the host kernel reads either).
  """
  kinds = gradient_memory_kinds(tx, params, flush)
  return jax.tree.map(lambda p, k: memory.with_kind(p, k), params, kinds)
