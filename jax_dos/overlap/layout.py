"""The staged model's parameters as the overlapped step's plan sees them (:class:`StepLayout`, :func:`step_layout`):
subgroups within groups, each one's stage, each leaf's size and the elements of its state a process and a device
hold, and the weights a step gathers ahead."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_dos.core import partition
from jax_dos.core.trees import leaves_with_paths
from jax_dos.memory import kinds as memory
from jax_dos.planning.plan import partition_groups
from jax_dos.planning.timeline import Subgroup
from jax_dos.staged import gather_ahead
from jax_dos.staged.stages import StagedModel


@dataclasses.dataclass(frozen=True)
class StepLayout:
  """A staged model's parameters as the plan sees them.

  ``subgroups`` (leaf indices) and ``sizes`` (elements) are
  ``jax_dos.planning.plan.partition_groups``'; ``stages`` gives each subgroup's stage,
  the one whose backward pass completes its gradient; ``leaf_sizes`` and
  ``leaf_bytes`` each leaf's elements and bytes per element; ``hand_over``
  every subgroup in the order the backward pass hands them over;
  ``leaf_held`` the elements of each leaf's state this process holds (its
  devices' shards, summed: ``memory.process_elements``), the leaf's size
  where not given; ``leaf_on_device`` the elements of each leaf's state one
  device holds (its shard: ``memory.device_elements``; ``1/N`` of a state
  partitioned over ``N`` devices), the leaf's size where not given;
  ``leaf_param_on_device`` the elements of each leaf's parameter one device
  holds (its shard: ``1/F`` over ``fsdp=F``), the leaf's size where not given;
  ``last_stages`` each subgroup's last stage using its group (whose backward
  pass starts its gradient's sum), its ``stages`` entry where not given;
  ``ahead_bytes`` the bytes one device holds of the largest stage's weights
  gathered whole ahead of its backward programs (``jax_dos.staged.gather_ahead``),
  0 where none are.
  """

  subgroups: tuple[tuple[int, ...], ...]
  sizes: tuple[int, ...]
  stages: tuple[int, ...]
  leaf_sizes: tuple[int, ...]
  leaf_bytes: tuple[int, ...]
  hand_over: tuple[int, ...] = ()
  leaf_held: tuple[int, ...] = ()
  leaf_on_device: tuple[int, ...] = ()
  leaf_param_on_device: tuple[int, ...] = ()
  last_stages: tuple[int, ...] = ()
  ahead_bytes: int = 0

  @property
  def device_share(self) -> float:
    """Elements of state one device holds a parameter of the model: what a resident or streamed parameter costs
    each device's memory (``1/N`` partitioned over ``N`` devices)."""
    return sum(self.leaf_on_device or self.leaf_sizes) / (sum(self.leaf_sizes) or 1)

  @property
  def params_sharded(self) -> bool:
    """Whether a device holds less than a whole parameter of some leaf (``fsdp``): the stage programs then gather
    the weights they use, and the plain program's peak is not the overlapped step's (``overlap.room``)."""
    return any(p < n for p, n in zip(self.leaf_param_on_device, self.leaf_sizes))

  @property
  def gradient_bytes(self) -> tuple[int, ...]:
    """Bytes one device holds of each subgroup's gradient: its leaves' elements in the state's layout (the
    gradients' in the stage programs, ``stage_programs.gradient_layouts``) at the parameters' itemsize."""
    per_leaf = [n * b for n, b in zip(self.leaf_on_device or self.leaf_sizes, self.leaf_bytes)]
    return tuple(sum(per_leaf[i] for i in leaves) for leaves in self.subgroups)

  @property
  def held(self) -> tuple[int, ...]:
    """Elements of each leaf's state this process holds."""
    return self.leaf_held or self.leaf_sizes

  @property
  def held_sizes(self) -> tuple[int, ...]:
    """Elements of each subgroup's state this process holds."""
    held = self.held
    return tuple(sum(held[i] for i in leaves) for leaves in self.subgroups)

  @property
  def held_share(self) -> float:
    """Elements this process holds a parameter of the model (``1/N`` partitioned over ``N`` processes)."""
    return sum(self.held) / (sum(self.leaf_sizes) or 1)

  @property
  def forward_order(self) -> list[int]:
    """Subgroup indices in the order the forward pass needs them."""
    return sorted(range(len(self.sizes)), key=lambda s: (self.stages[s], s))

  def timeline(self) -> list[Subgroup]:
    return [Subgroup(n, self.stages[s], self.leaf_bytes[self.subgroups[s][0]]) for s, n in enumerate(self.sizes)]


def step_layout(model: StagedModel, groups: list, subgroup_size: int, partitioned: bool = True) -> StepLayout:
  """The parameter groups as the plan sees them: subgroups within groups, each one's stage, each leaf's size, and
  the elements of each leaf's state this process holds (partitioned over the mesh axes a parameter is replicated
  over where ``partitioned``, as ``partition.state_layout``; else in the parameter's layout)."""
  leaves, _ = leaves_with_paths(list(groups), "params")
  state = partition.state_layout(list(leaves)) if partitioned else leaves
  subgroups, sizes, group_of = partition_groups(groups, subgroup_size)
  of_group = [[s for s, g in enumerate(group_of) if g == gi] for gi in range(len(groups))]
  hand_over = [s for i in reversed(range(len(model.stages))) for g in model.groups_completing(i) for s in of_group[g]]
  stage_params = [tuple(groups[g] for g in st.groups) for st in model.stages]
  ahead = [gather_ahead.gathered_bytes(jax.tree.leaves(p)) for p in stage_params[:-1] if model.gathers(p)]
  return StepLayout(
    tuple(subgroups), tuple(sizes), tuple(model.completion[g] for g in group_of),
    tuple(int(x.size) for x in leaves), tuple(jnp.result_type(x).itemsize for x in leaves), tuple(hand_over),
    tuple(memory.process_elements(x) for x in state), tuple(memory.device_elements(x) for x in state),
    tuple(memory.device_elements(x) for x in leaves),
    tuple(max(i for i, st in enumerate(model.stages) if g in st.groups) for g in group_of), max(ahead, default=0),
  )  # fmt: skip
