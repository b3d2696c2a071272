"""The overlapped step's pinned host memory: what this process pins, against its budget and its share of the host.

Counted from shapes, before anything is allocated, in the elements of each
leaf's state that this process holds (``StepLayout.leaf_held``: its devices'
shards, summed). A state partitioned over a data-parallel mesh of ``N``
processes is ``1/N`` of each leaf a process; one kept whole per device is a
copy a device. The terms, a parameter held: its offloaded state (12 B; 8 with
bfloat16 moments, about 6 with int8); on the host path a spare state (as
much) and its gradient and weight copies (2 B each for bfloat16 parameters, 4
for float32); a streamed parameter speculated on, its new state until the
clip decision (:func:`host_bytes`).

:func:`check_host_memory` refuses a plan, with the numbers and what to
change, where those bytes exceed the step's budget (``host_budget_bytes``),
this process's share of its host's pinned pool (``host_plan.pool_share``: the
host's RAM shared by the job's processes on it), or what the host's
processes need together against its RAM (``pinned_pool.check_host_capacity``).
"""

from __future__ import annotations

import math
from typing import Any

from jax_dos.core import moment_formats
from jax_dos.memory import host_ram, pinned_pool
from jax_dos.planning import host_plan
from jax_dos.planning.plan import Plan
from jax_dos.planning.timeline import HostBytes

# The share of RAM the step plans its pinned host memory into where no host_budget_bytes is given (the state, spare
# host state, streamed speculation): at 6.7B on a 125.9 GiB H100 host the process's resident set reached 97% of RAM
# with 79% planned, XLA's pinned pool growing by doubling regions (docs/overlap.md).
HOST_SHARE = 0.85


def host_bytes_per(moments: str = "float32", held_share: float = 1.0) -> HostBytes:
  """:class:`HostBytes` with the state of ``moments`` (``moment_formats.state_bytes_per_param``: 12, 8, about 6), a
  parameter of the whole model; ``held_share``: the elements this process holds a parameter of the model (the
  timeline places whole subgroups)."""
  state = moment_formats.state_bytes_per_param(moments) * held_share
  return HostBytes(state=state, spare=state, speculation=state)


def fixed_host_bytes(plan: Plan, layout: Any, moments: str = "float32") -> int:
  """:func:`host_bytes` before the streamed speculation (``layout``: the plan's ``overlap.layout.StepLayout``)."""
  per = host_bytes_per(moments)
  held = layout.held
  return int(sum(held[i] * per.per_parameter(placement, layout.leaf_bytes[i])
                 for placement, leaves in zip(plan.placements, plan.subgroups) for i in leaves))  # fmt: skip


def speculation_cap(plan: Plan, layout: Any, budget: int, moments: str = "float32") -> int:
  """Streamed elements (of those this process holds) a step may speculate on: as many as ``budget`` holds beside the
  fixed bytes."""
  return max(0, int((budget - fixed_host_bytes(plan, layout, moments)) // host_bytes_per(moments).speculation))


def host_bytes(plan: Plan, layout: Any, speculation: int | None, moments: str = "float32") -> int:
  """Pinned host bytes this process needs at most: the fixed bytes and the new state of the streamed elements
  speculated on (``speculation`` of them at most, ``None``: all it holds)."""
  held = layout.held_sizes
  streamed = sum(held[s] for s in plan.indices("stream"))
  cap = streamed if speculation is None else min(streamed, speculation)
  return fixed_host_bytes(plan, layout, moments) + int(host_bytes_per(moments).speculation * cap)


def _gib(nbytes: float) -> str:
  """``nbytes`` in GiB, or in bytes below 1 MiB (a small layout's figures would read 0.00 GiB)."""
  return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**20 else f"{int(nbytes):,} bytes"


def host_refusal(need: int, host: host_plan.HostMemory, moments: str = "float32") -> str | None:
  """Why ``need`` pinned bytes a process do not fit its share of ``host``'s pinned pool, or ``None`` if they do."""
  share = host_plan.pool_share(host)
  if need <= share:
    return None
  shared = f" shared by {host.processes} processes" if host.processes > 1 else ""
  per = "each of the processes on this host" if host.processes > 1 else "this process"
  return (
    f"the overlapped step's host memory does not fit this host's RAM: {per} needs {_gib(need)} of pinned host"
    f" memory (its offloaded state at {moment_formats.state_bytes_per_param(moments):.3g} B a parameter it holds"
    f" with {moments} moments, the host path's spare state and copies, the streamed speculation), and its pinned"
    f" pool may hold {_gib(share)} ({pinned_pool.DEFAULT_POOL_FRACTION:.0%} of {_gib(host.ram_bytes)} RAM{shared})."
    " Change one of: "
    + ("moments='bfloat16' or 'int8' (--moments: 8 or about 6 B a parameter, not 12), " if moments == "float32" else "")
    + "fewer processes on this host (spread them over more hosts), a smaller model, more subgroups on the device"
    " (a resident budget, --offload auto), or the plain step (tx.update after jax.grad; --overlap off), which needs"
    " no spare host state."
  )


def check_host_memory(
  plan: Plan,
  layout: Any,
  speculation: int | None,
  budget: int,
  moments: str = "float32",
  host: host_plan.HostMemory | None = None,
  on_host: tuple[int, int] | None = None,
  released: int = 0,
) -> None:
  """A ``MemoryError`` naming what to change where the plan's host bytes exceed ``budget``, this process's share of
  ``host`` (if given), or the machine (``on_host``: ``host_ram.bytes_on_this_host``'s figures for the host's
  processes together); ``released``: host bytes of a given state that the step frees as it moves it."""
  need = host_bytes(plan, layout, speculation, moments)
  try:
    if need > budget:
      raise MemoryError(
        f"the overlapped step's host memory needs {_gib(need)} of pinned host memory, above the {_gib(budget)} of"
        f" its budget (host_budget_bytes, or {HOST_SHARE:.0%} of RAM). Raise the budget, keep more subgroups on the"
        " device, or train on the plain path (tx.update after jax.grad), which needs no spare host state."
      )
    refusal = None if host is None else host_refusal(need, host, moments)
    if refusal is not None:
      raise MemoryError(refusal)
    pinned_pool.check_host_capacity(need, "the overlapped step's host memory", on_host, released)
  except MemoryError as e:
    raise MemoryError(f"{e}\nThe overlapped step's plan:\n{plan}") from None


def check_agreed(
  plan: Plan, layout: Any, speculation: int | None, budget: int, moments: str, host: host_plan.HostMemory, spans: bool,
  released: int = 0,
) -> None:  # fmt: skip
  """:func:`check_host_memory` for a step whose tree ``spans`` the job's processes or not: with ``spans`` the host's
  processes are counted together and the refusal is agreed, raised on every process of the job if on one (a
  collective, which every process reaches)."""
  on_host = host_ram.bytes_on_this_host(host_bytes(plan, layout, speculation, moments)) if spans else None
  try:
    check_host_memory(plan, layout, speculation, budget, moments, host, on_host, released)
    message = None
  except MemoryError as e:
    message = str(e)
  message = host_plan.agreed_refusal(message) if spans else message
  if message is not None:
    raise MemoryError(message)


def default_host_budget() -> int:
  """``HOST_SHARE`` of RAM, and no more than XLA's pinned pool (on a GPU)."""
  budget = int(HOST_SHARE * host_ram.host_memory_total())
  pool = pinned_pool.pinned_pool_limit()
  return budget if pool is None else min(budget, pool)


def host_need_bound(
  num_params: int, param_bytes: int = 2, *, overlapped: bool = False, moment_copies: bool = False,
  host_memory_bytes: int | None = None, moments: str = "float32",
) -> int:  # fmt: skip
  """The most pinned host bytes a step of ``num_params`` parameters plans, from the count alone.

  For a pool cap set before jax starts (``jax_dos.cap_pinned_pool``), when no
  plan can be made yet. The plain step with every subgroup offloaded:
  ``STATE_BYTES`` and a gradient or weight copy (4 B) a parameter, 4 B more
  with ``moment_copies`` (``delay_predict="gradient"``). The overlapped step
  (``overlapped``): the host path's ``timeline.HostBytes`` a parameter (state,
  spare state, gradient and weight copies of ``param_bytes`` each), and no
  more than its default host budget, ``HOST_SHARE`` of the host's RAM
  (``host_memory_bytes``, default the machine's); and the plain step's, which
  a refused overlapped step falls back to, where that fits the host beside
  ``host_ram.HOST_HEADROOM_BYTES`` (13B with int8 moments on a 125.9 GiB host:
  the plain step's 120 GiB does not, and would cap XLA's pool, which takes its
  whole cap once the need passes 64 GiB, 13 GiB above the overlapped step's
  budget).
  """
  state = moment_formats.state_bytes_per_param(moment_formats.check(moments))
  plain = math.ceil((state + 4 + (4 if moment_copies else 0)) * num_params)
  if not overlapped:
    return plain
  total = host_ram.host_memory_total() if host_memory_bytes is None else host_memory_bytes
  per = host_bytes_per(moments).per_parameter("host", param_bytes)
  overlapped_need = min(math.ceil(per * num_params), int(HOST_SHARE * total))
  plain_fits = plain + host_ram.HOST_HEADROOM_BYTES <= total
  return max(plain, overlapped_need) if plain_fits else overlapped_need
