"""jax-dos: Adam(W) for JAX whose optimizer state lives in host memory.

A port of *Deep Optimizer States* (Maurya et al., 2024: interleaved offloading)
to JAX/XLA. Public API::

    tx = jax_dos.interleaved_adam(3e-4, weight_decay=0.1)   # an optax transformation
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)        # eager: the fast engine
    params, state = jax_dos.update_params(tx, grads, state, params)  # the same, with no fp32 update tree

Jit the gradient function with ``out_shardings=(None, jax_dos.gradient_shardings(tx, params))``
to send host subgroups' gradients to host memory during the backward pass.

The package, from the ground up (docs/design.md, "Layout"); each package's ``__init__`` lists its modules floor by
floor::

    trace.py, job_thread.py, hand_off.py   spans on request, the worker threads, one holder a buffer between them
    subnormals.py, parallel_launch.py      one parallel numba kernel at a time in the process, subnormals flushed
    memory/       memory kinds, the host's RAM, XLA's pinned pool and our own arena, copies, configure_process
    core/         the state, the tree, moment formats, partition, Adam's arithmetic
    kernels/      the host kernels
    planning/     one performance model: the Plan, rates, the timeline, budgets, the calibration and the planner
    staged/       stages, their programs, randomness, remat, gathering ahead, the NNX adapter
    optimizer/    interleaved_adam: the traced update, the eager engine and its paths, accumulation
    checkpoint/   Orbax save and restore of the offloaded state, optax's state and back
    overlap/      the overlapped step: its plan, threads, host and stream paths, clip decision

``planning``'s lower floors (the Plan, the timeline) are data the optimizer and the stages read; its calibration
measures the real engine, so it and the planner stand above ``optimizer``'s engine, below its ``transform``.

Importing it changes nothing outside itself: what XLA reads when its backend starts is set by an explicit call,
``jax_dos.configure_process()`` (docs/api.md, "What importing jax_dos changes").
"""

from jax_dos import trace
from jax_dos.checkpoint import CheckpointManager, DamagedCheckpointWarning, TemplateMismatchError
from jax_dos.checkpoint.integrity import DAMAGED_DIR
from jax_dos.checkpoint.optax_state import from_optax_adamw_state, to_optax_adamw_state
from jax_dos.core.adam_math import AdamHyper, clip_scale
from jax_dos.core.moment_formats import FORMATS as MOMENT_FORMATS
from jax_dos.core.moment_formats import state_bytes_per_param
from jax_dos.core.partition import state_shardings
from jax_dos.core.state import InterleavedAdamState
from jax_dos.memory.configure import configure_process
from jax_dos.memory.kinds import DeviceMemory
from jax_dos.memory.pinned_pool import cap_pinned_pool, resident_estimate
from jax_dos.optimizer.accumulate import multi_steps
from jax_dos.optimizer.engine import wait_for_host_updates
from jax_dos.optimizer.interleaved import DELAY_PREDICTIONS, InterleavedAdamTransformation, TracedUpdateWarning
from jax_dos.optimizer.transform import (
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
from jax_dos.overlap.clip import resolved_speculation
from jax_dos.overlap.memory import host_need_bound
from jax_dos.overlap.plan import abstract_state
from jax_dos.overlap.plan import plan_step as overlapped_plan
from jax_dos.overlap.process import NO_COMMAND_BUFFERS
from jax_dos.overlap.step import OverlappedStep
from jax_dos.planning import fired, timeline
from jax_dos.planning.budgets import StepMemory
from jax_dos.planning.calibration import accelerator_calibration_cached, calibrate
from jax_dos.planning.calibration import cache_dir as calibration_cache_dir
from jax_dos.planning.collectives import Collectives
from jax_dos.planning.cost_model import Calibration
from jax_dos.planning.host_plan import HostMemory, agreed_refusal, pool_share, share_pinned_pool
from jax_dos.planning.link import measure_link, mesh_collectives
from jax_dos.planning.plan import PLACEMENTS, Plan, partition_leaves, resolve_plan
from jax_dos.planning.planner import auto_planner, make_plan
from jax_dos.planning.timeline import PREDICTION_ERROR, RematCosts, StageTimes
from jax_dos.staged.nnx_adapter import NNXStages, nnx_stages
from jax_dos.staged.remat import PLANNED_POLICIES as PLANNED_REMAT_POLICIES
from jax_dos.staged.remat import REMAT_NAMES, REMAT_POLICIES, checkpoint_policy, rematerialise
from jax_dos.staged.remat import compiler_options as remat_compiler_options
from jax_dos.staged.remat import describe as describe_remat
from jax_dos.staged.stages import Stage, StagedModel

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
