"""A data-parallel step's collectives as the timeline prices them: reductions, gathers, and the host shared.

On a mesh of ``N`` devices the step reduce-scatters each stage's gradient sum and all-gathers the new weights
(``docs/scaling.md``); both move ``(N - 1) / N`` of their bytes over each device's link, at its measured bus
bandwidth (``planning.link.measure_link``). ``timeline.simulate`` and ``simulate_fired`` take a
:class:`Collectives` for one rank's view of the step.
"""

from __future__ import annotations

import dataclasses

from jax_dos.rates import Rates


@dataclasses.dataclass(frozen=True)
class Collectives:
  """The collectives of a data-parallel step over ``ranks`` devices, ``ranks_per_host`` of them sharing a host's DRAM
  and cores (``docs/scaling.md``): the devices of one process, or one process a device, or both.

  ``link``: bytes a second each device's link moves each way (the collective's bus bandwidth,
  :func:`jax_dos.measure_link`). ``partitioned``: each rank holds and updates ``1/ranks`` of the state; each stage's
  gradient sum is reduce-scattered after its backward pass (``(ranks - 1) / ranks`` of its ``grad_bytes`` a
  parameter on the link), and the new weights are all-gathered (``(ranks - 1) / ranks`` of ``param_bytes``) before
  the next forward pass reaches the stage (``OverlappedStep``'s stage programs put them in the partitioned layout,
  which XLA reduce-scatters). Not partitioned (``partition_replicated=False``): each gradient sum is all-reduced
  (twice a reduce-scatter's bytes), every rank updates the whole state, and nothing is gathered. The host and the
  stream paths' rates are the host's DRAM's, shared by its ranks: each gets ``1 / ranks_per_host`` of them
  (:meth:`shared_rates`).
  """

  ranks: int
  link: float
  grad_bytes: int = 2
  param_bytes: int = 2
  partitioned: bool = True
  ranks_per_host: int = 1

  def __post_init__(self):
    if self.ranks < 1 or not 1 <= self.ranks_per_host <= self.ranks or not self.link > 0:
      raise ValueError("Collectives needs ranks >= 1, 1 <= ranks_per_host <= ranks and a link rate > 0 bytes/s.")

  def reduce_s(self, size: int) -> float:
    """Seconds on the link to reduce the gradient sums of ``size`` parameters (a reduce-scatter or an all-reduce)."""
    share = (self.ranks - 1) / self.ranks * (1 if self.partitioned else 2)
    return size * self.grad_bytes * share / self.link

  def gather_s(self, size: int) -> float:
    """Seconds on the link to all-gather the new weights of ``size`` parameters (none unless partitioned)."""
    return size * self.param_bytes * (self.ranks - 1) / self.ranks / self.link if self.partitioned else 0.0

  def plain_step_s(self, size: int, micro_batches: int) -> float:
    """Seconds the plain step's collectives add to its step over ``size`` parameters, none hidden: each
    micro-batch's gradients reduced, then (partitioned) the new weights gathered (``docs/scaling.md``'s model)."""
    return micro_batches * self.reduce_s(size) + self.gather_s(size)

  def updated(self, size: int) -> float:
    """Parameters of a ``size``-parameter subgroup this rank updates."""
    return size / self.ranks if self.partitioned else size

  def shared_rates(self, rates: Rates) -> Rates:
    """``rates`` a rank gets: the host and the stream paths' shared by the host's ranks (both cross the host's DRAM
    24-28 bytes a parameter, and the DRAM binds, not the PCIe links, which add up: ``docs/scaling.md``, rule 1);
    each device updates its resident share at its own rate."""
    n = self.ranks_per_host
    backward = None if rates.stream_backward is None else rates.stream_backward / n
    return dataclasses.replace(
      rates, host=rates.host / n, host_concurrent=rates.host_concurrent / n, stream=rates.stream / n,
      stream_concurrent=rates.stream_concurrent / n, stream_backward=backward,
    )  # fmt: skip
