"""``interleaved_adam``: optax's AdamW with its state offloaded to host memory, and the functions around it.

Drop-in for ``optax.adamw``: same hyperparameters, same numbers. The state is
a pytree of ordinary ``jax.Array`` s mirroring the parameters (fp32 master
weights, mu, nu) plus a step count (``state.py``); each leaf lives in
``pinned_host`` or ``device`` memory according to the plan (``plan.py``), which
the performance model chooses by default (``planning/``). The optimizer itself,
traced or eager, is ``interleaved.py``'s.

Gradient flush: jit the gradient function with
``out_shardings=gradient_shardings(tx, params)`` (for its gradient output):
XLA then writes the gradients of host subgroups to ``pinned_host`` memory
itself, copying each one out of the accelerator inside the backward pass, and
the engine finds them on the host already (float32 or bfloat16, which the
host kernel reads as they are).

:func:`get_plan`, :func:`gradient_memory_kinds` and :func:`gradient_shardings`
take the transformation ``interleaved_adam`` returned, alone or inside an
``optax.chain`` (or ``jax_dos.multi_steps``); :func:`update_params` takes it
alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import numpy as np
import optax

from jax_dos.core import moment_formats, partition
from jax_dos.core.adam_math import AdamHyper, ScalarOrSchedule
from jax_dos.core.state import InterleavedAdamState
from jax_dos.core.trees import tree_without_variables
from jax_dos.memory import kinds as memory
from jax_dos.optimizer.interleaved import (
  InterleavedAdam,
  InterleavedAdamTransformation,
  Planner,
  find_interleaved,
  prediction_mode,
)
from jax_dos.planning.host_plan import HostMemory
from jax_dos.planning.plan import Plan, PlanSpec
from jax_dos.planning.planner import auto_planner

DEFAULT_SUBGROUP_SIZE = 64 * 2**20  # 256 MiB of fp32 per state array; see docs/design.md
DEFAULT_DELAY_WARMUP = 10  # normal steps before delay=1 starts


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
  planner: Optional[Planner] = None,
  delay: int = 0,
  delay_warmup: int = DEFAULT_DELAY_WARMUP,
  delay_predict: Union[bool, str] = False,
  write_behind: bool = False,
  partition_replicated: Union[bool, str] = "auto",
  moments: str = "float32",
  host_memory: Optional[HostMemory] = None,
) -> InterleavedAdamTransformation:
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
    delay_warmup: normal steps before the delay starts (default 10). The
      layers below (``InterleavedAdam``, ``traced.update_leaves``, the
      engine) take it without a default: this is the only one.
    delay_predict: with ``delay=1``, what the forward pass of step ``t + 1``
      gets for host subgroups instead of the stale masters of step ``t - 1``
      (moments and masters still follow Adam exactly on the gradients they
      are given, on the host):

      - ``"moments"`` (or ``True``): a prediction of step ``t``'s masters, one
        more AdamW step that leaves the moments as they are
        (``adam_math.predict_next``), written by the host kernel in the same
        pass (4 B of host memory per float32 parameter).
      - ``"gradient"``: step ``t``'s masters themselves: copies of master, mu
        and nu after step ``t - 1`` go to the accelerator during step ``t``'s
        forward/backward pass, and ``update`` takes step ``t``'s AdamW step
        there: the trajectory of undelayed AdamW (float32 parameters: the same
        numbers to float32 rounding), while the exact float32 step still runs
        on the host, hidden behind the next pass. Memory and PCIe costs:
        ``docs/api.md``, "The delayed update and write-behind".

      Stale momentum is what makes the plain delay converge worse (docs/design.md, BENCHMARKS.md).
    write_behind: keep optax's numbers exactly and hide part of the host
      update: the kernel computes the new weights first, ``update`` returns
      once they are sent, and a second pass writes master, mu and nu during
      the caller's next forward/backward pass (``docs/api.md``). With
      ``plan="auto"`` streamed subgroups become host ones. Not with ``delay``.
    partition_replicated: on a mesh, a parameter replicated over some of its
      axes (data parallelism) keeps its Adam state partitioned over them
      (ZeRO-1/2 style: each device updates ``1/N`` of it, the new parameters
      gathered back; ``docs/api.md``, "Accumulation, sharding,
      checkpoints"). ``"auto"`` (default): so wherever a parameter is
      replicated over more than one device; ``jax_dos.OverlappedStep`` keeps
      the parameters' layout instead. ``True``: the same, and
      ``OverlappedStep`` refuses it. ``False``: every device keeps a whole copy.
    moments: how ``mu`` and ``nu`` are stored beside the float32 master
      (``jax_dos.core.moment_formats``): ``"float32"`` (default; optax's numbers,
      12 B of state a parameter), ``"bfloat16"`` (stochastically rounded,
      8 B) or ``"int8"`` (8-bit codes with a float32 scale per block of 256,
      square-root companded, about 6 B). The step itself is float32 in
      optax's order on the decoded moments, and every path (host, stream,
      device, traced) encodes with the same rounding and random bits.
      Compact moments take ``delay_predict=False``; ``"int8"`` keeps each
      leaf's moments on one device (no partitioned or sharded state).
    host_memory: the host's RAM and the job's processes on it
      (``jax_dos.HostMemory``), against which the plan's pinned state is
      checked before anything is allocated; ``None`` (default): this
      machine's. A plan whose state does not fit each process's share of the
      RAM is refused with a ``MemoryError`` on every process.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (an
    :class:`~jax_dos.optimizer.interleaved.InterleavedAdamTransformation`, whose
    ``interleaved`` is the optimizer behind it). Its ``update`` requires
    ``params``. Eagerly (outside ``jit``) it consumes ``state`` in place; inside
    ``jit`` it is pure. ``update(grads, state, params, grad_scale=s)`` takes
    ``s * grads`` as the gradients (a scalar, on any device); with
    ``s = jax_dos.clip_scale(optax.global_norm(grads), max_norm)`` that is
    ``optax.chain(optax.clip_by_global_norm(max_norm), adamw)`` without
    rescaling the gradients on the accelerator first, which lets XLA flush
    host subgroups' gradients during the backward pass (see ``docs/design.md``).
  """
  hyper = AdamHyper(learning_rate, b1, b2, eps, eps_root, weight_decay, moment_formats.check(moments))
  if planner is None and isinstance(plan, str) and plan == "auto":
    ahead = prediction_mode(delay_predict) == "gradient"
    planner = auto_planner(ahead_copies=ahead, moments=moment_formats.check(moments))  # calibrates on first use
  opt = InterleavedAdam(
    hyper, mask=mask, subgroup_size=subgroup_size, plan=plan, planner=planner, delay=delay, delay_warmup=delay_warmup,
    delay_predict=delay_predict, write_behind=write_behind, partition_replicated=partition_replicated,
    host_memory=host_memory,
  )  # fmt: skip
  return InterleavedAdamTransformation.of(opt)


def interleaved_adamw(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  weight_decay: float = 1e-4,
  mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
  **kwargs,
) -> InterleavedAdamTransformation:
  """:func:`interleaved_adam` with ``optax.adamw``'s default ``weight_decay=1e-4``."""
  return interleaved_adam(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, **kwargs)


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
  Eagerly it consumes ``params`` and ``state`` like donated arguments: the
  arrays passed in are deleted, so reassign both as above (reading an old
  parameter afterwards raises JAX's ``Array has been deleted``); inside
  ``jit`` it is pure. ``tx`` must be the transformation itself, not a chain of
  it: the chain's other members would transform an update tree that is never
  made. Clip with ``grad_scale=jax_dos.clip_scale(optax.global_norm(grads), c)``.
  """
  opt, alone = find_interleaved(tx, params, "update_params")
  if not alone:
    raise TypeError(
      "update_params takes the transformation returned by jax_dos.interleaved_adam itself, not a chain of it: the"
      " chain's other members would transform an update tree that update_params never makes. Call tx.update and"
      " optax.apply_updates instead, or clip with grad_scale=jax_dos.clip_scale(optax.global_norm(grads), max_norm)."
    )
  return opt.update_params(grads, state, params, grad_scale)


def get_plan(tx: optax.GradientTransformation, params: Any) -> Plan:
  """The :class:`Plan` an ``interleaved_adam`` transformation (alone or in an ``optax.chain``) uses for ``params``."""
  return find_interleaved(tx, params, "get_plan")[0].plan_for(params)


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

  ``params`` may be a Flax NNX ``nnx.State`` (``nnx.state(model, nnx.Param)``): the kinds are then plain strings
  where the state holds ``nnx.Param`` s (not ``Param`` s of strings), in the state's structure.
  """
  _check_flush(flush)
  opt = find_interleaved(tx, params, "gradient_memory_kinds")[0]
  return tree_without_variables(params, _gradient_kinds(opt, params, flush))


def _check_flush(flush: str) -> None:
  if flush not in GRADIENT_FLUSHES:
    raise ValueError(f"flush must be one of {GRADIENT_FLUSHES}, got {flush!r}.")


def _gradient_kinds(opt: InterleavedAdam, params: Any, flush: str) -> list[str]:
  """:func:`gradient_memory_kinds` for the optimizer ``opt`` (found once by the caller), one per leaf in order."""
  leaves = jax.tree.leaves(params)
  return [
    "pinned_host" if (flush == "all" or p == "host") and np.size(x) else "device"
    for p, x in zip(opt.plan_for(params).leaf_placements(), leaves)
  ]


def gradient_shardings(tx: optax.GradientTransformation, params: Any, flush: str = "host") -> Any:
  """Output shardings for a jitted gradient function: each parameter's sharding, in the memory it is flushed to.

  The memory is :func:`gradient_memory_kinds`'s: host memory for host
  subgroups' gradients (for every gradient with ``flush="all"``). With
  ``partition_replicated``, a replicated parameter's gradient takes its
  state's partitioned layout (XLA then reduces and scatters it).

  Use as the gradients' part of ``jax.jit(..., out_shardings=...)``::

      grad_fn = jax.jit(jax.value_and_grad(loss), out_shardings=(None, jax_dos.gradient_shardings(tx, params)))

  ``params`` may be a Flax NNX ``nnx.State`` (``nnx.state(model, nnx.Param)``, or the state half of
  ``nnx.split(model, nnx.Param, ...)``): the result is then that state's structure with a plain ``Sharding`` where
  the state holds an ``nnx.Param``, which ``nnx.jit`` takes as ``out_shardings`` for gradients of that state
  (``nnx.grad``'s) and ``jax.jit`` as a prefix of them (a ``Sharding`` wrapped in a ``Param``, what mapping over
  the state would give, ``nnx.jit`` refuses).

  Gradients must be float32 or bfloat16 (the host kernel reads either).
  """
  _check_flush(flush)
  opt = find_interleaved(tx, params, "gradient_shardings")[0]  # (in a chain: one abstract trace of its init)
  kinds = _gradient_kinds(opt, params, flush)
  partitioned = opt.partitions

  def sharding(p, kind):  # partitioned: each device gets its share of a replicated gradient
    return partition.state_sharding_in(p, kind) if partitioned else memory.with_kind(p, kind)

  return tree_without_variables(params, [sharding(p, k) for p, k in zip(jax.tree.leaves(params), kinds)])
