"""jax-dos: Adam(W) for JAX whose optimizer state lives in host memory.

A port of *Deep Optimizer States* (Maurya et al., 2024: interleaved offloading)
to JAX/XLA. Public API::

    tx = jax_dos.interleaved_adam(3e-4, weight_decay=0.1)   # an optax transformation
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)        # eager: the fast engine
    params, state = jax_dos.update_params(tx, grads, state, params)  # the same, with no fp32 update tree

Jit the gradient function with ``out_shardings=(None, jax_dos.gradient_shardings(tx, params))``
to send host subgroups' gradients to host memory during the backward pass.

The package, from the ground up: ``state``, ``adam_math``, ``memory`` (array placement), ``host_ram`` (the
host's RAM) and ``pinned_pool`` (XLA's pinned host pool and its cap), ``plan``, ``trace`` and ``host_kernels``; the two
ways to run a step, ``traced`` and ``engine`` (with ``step_ahead``); the optimizer,
``interleaved``; the planning wing, ``planning/``; ``transform`` (the optax
face) with ``accumulate`` and the package ``checkpoint/`` (Orbax; optax's state and back); the overlapped step,
``stages``, ``timeline`` (with ``fired``: a step after a fired clip, and its bound) and the package ``overlap/``
(its plan, the step, its host and stream paths, the clip decision), with
``remat`` (the rematerialisation policies), ``job_thread`` (its worker threads and their one failure event) and
``hand_off`` (one holder a buffer between them) below them, and ``nnx_adapter`` (a Flax NNX model's stages)
(docs/design.md).

Importing it changes nothing outside itself: what XLA reads when its backend starts is set by an explicit call,
``jax_dos.configure_process()`` (docs/api.md, "What importing jax_dos changes").
"""

from jax_dos import fired, timeline, trace
from jax_dos.accumulate import multi_steps
from jax_dos.adam_math import AdamHyper, clip_scale
from jax_dos.checkpoint import CheckpointManager, DamagedCheckpointWarning, TemplateMismatchError
from jax_dos.checkpoint.integrity import DAMAGED_DIR
from jax_dos.checkpoint.optax_state import from_optax_adamw_state, to_optax_adamw_state
from jax_dos.collectives import Collectives
from jax_dos.configure import configure_process
from jax_dos.engine import wait_for_host_updates
from jax_dos.host_plan import HostMemory, agreed_refusal, pool_share, share_pinned_pool
from jax_dos.interleaved import DELAY_PREDICTIONS, InterleavedAdamTransformation, TracedUpdateWarning
from jax_dos.memory import DeviceMemory
from jax_dos.moment_formats import FORMATS as MOMENT_FORMATS
from jax_dos.moment_formats import state_bytes_per_param
from jax_dos.nnx_adapter import NNXStages, nnx_stages
from jax_dos.overlap.clip import resolved_speculation
from jax_dos.overlap.memory import host_need_bound
from jax_dos.overlap.plan import abstract_state
from jax_dos.overlap.plan import plan_step as overlapped_plan
from jax_dos.overlap.process import NO_COMMAND_BUFFERS
from jax_dos.overlap.step import OverlappedStep
from jax_dos.partition import state_shardings
from jax_dos.pinned_pool import cap_pinned_pool, resident_estimate
from jax_dos.plan import PLACEMENTS, Plan, partition_leaves, resolve_plan
from jax_dos.planning.budgets import StepMemory
from jax_dos.planning.calibration import accelerator_calibration_cached, calibrate
from jax_dos.planning.calibration import cache_dir as calibration_cache_dir
from jax_dos.planning.cost_model import Calibration
from jax_dos.planning.link import measure_link, mesh_collectives
from jax_dos.planning.planner import auto_planner, make_plan
from jax_dos.remat import PLANNED_POLICIES as PLANNED_REMAT_POLICIES
from jax_dos.remat import REMAT_NAMES, REMAT_POLICIES, checkpoint_policy, rematerialise
from jax_dos.remat import compiler_options as remat_compiler_options
from jax_dos.remat import describe as describe_remat
from jax_dos.stages import Stage, StagedModel
from jax_dos.state import InterleavedAdamState
from jax_dos.timeline import PREDICTION_ERROR, RematCosts, StageTimes
from jax_dos.transform import (
  DEFAULT_DELAY_WARMUP,
  DEFAULT_SUBGROUP_SIZE,
  GRADIENT_FLUSHES,
  get_plan,
  gradient_memory_kinds,
  gradient_shardings,
  interleaved_adam,
  interleaved_adamw,
  update_params,
)

__all__ = [
  "PREDICTION_ERROR",
  "AdamHyper",
  "abstract_state",
  "agreed_refusal",
  "Calibration",
  "CheckpointManager",
  "Collectives",
  "DAMAGED_DIR",
  "DamagedCheckpointWarning",
  "DEFAULT_DELAY_WARMUP",
  "DEFAULT_SUBGROUP_SIZE",
  "DELAY_PREDICTIONS",
  "DeviceMemory",
  "MOMENT_FORMATS",
  "pool_share",
  "GRADIENT_FLUSHES",
  "HostMemory",
  "InterleavedAdamState",
  "InterleavedAdamTransformation",
  "NNXStages",
  "NO_COMMAND_BUFFERS",
  "PLACEMENTS",
  "PLANNED_REMAT_POLICIES",
  "Plan",
  "REMAT_NAMES",
  "REMAT_POLICIES",
  "RematCosts",
  "StepMemory",
  "auto_planner",
  "accelerator_calibration_cached",
  "calibrate",
  "calibration_cache_dir",
  "cap_pinned_pool",
  "configure_process",
  "checkpoint_policy",
  "clip_scale",
  "describe_remat",
  "from_optax_adamw_state",
  "OverlappedStep",
  "overlapped_plan",
  "Stage",
  "StagedModel",
  "StageTimes",
  "TemplateMismatchError",
  "get_plan",
  "gradient_memory_kinds",
  "gradient_shardings",
  "host_need_bound",
  "state_bytes_per_param",
  "state_shardings",
  "interleaved_adam",
  "interleaved_adamw",
  "make_plan",
  "measure_link",
  "mesh_collectives",
  "multi_steps",
  "nnx_stages",
  "partition_leaves",
  "resident_estimate",
  "rematerialise",
  "remat_compiler_options",
  "resolve_plan",
  "resolved_speculation",
  "to_optax_adamw_state",
  "timeline",
  "fired",
  "TracedUpdateWarning",
  "trace",
  "share_pinned_pool",
  "update_params",
  "wait_for_host_updates",
]
__version__ = "0.1.0"
