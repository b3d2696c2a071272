"""A data-parallel step's collectives as the timeline prices them: reductions, gathers, and the host shared.

On a mesh of ``N`` devices the step reduce-scatters each stage's gradient sum and all-gathers the new weights
(``docs/scaling.md``); both move ``(N - 1) / N`` of their bytes over each device's link, at its measured bus
bandwidth (``planning.link.measure_link``). ``timeline.simulate`` and ``simulate_fired`` take a
:class:`Collectives` for one rank's view of the step.
"""

from __future__ import annotations

import dataclasses

from jax_dos.planning.rates import Rates

# A streamed parameter's host DRAM bytes against the host kernel's: its state read and written by DMA and its gradient
# (2 (4 + 2 b) + 2 B) against the kernel's 4 + 8 + 4 b (float32 26/28, bfloat16 18/20, int8 14/16).
STREAM_DRAM_SHARE = 0.9


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
  (twice a reduce-scatter's bytes), every rank updates the whole state, and nothing is gathered. The host's ranks
  share its DRAM, each its own PCIe link (:meth:`shared_rates`).
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
    """``rates`` a rank gets, ``n`` ranks sharing the host's DRAM, each with its own PCIe link (``docs/scaling.md``,
    rule 1); each device updates its resident share at its own rate.

    With the host kernel's rate alone ``k`` (the DRAM's speed, in kernel parameters a second; ``rates.host_kernel``)
    a rank's host path takes ``n / k`` a parameter for its kernel (the DRAM shared) and ``1/h - 1/k`` for the rest,
    its copies on its own link: ``h_n = 1 / (n/k + 1/h - 1/k)``. A streamed parameter moves
    :data:`STREAM_DRAM_SHARE` of a kernel parameter's DRAM bytes, so each rank streams at ``min(s, k / (0.9 n))``.
    Both paths at once on every rank ask the DRAM for ``n (h_c + 0.9 s_c)``: beyond ``k``, both concurrent rates
    are scaled down to fit; a rank's kernel alone runs at ``k / n``. Without ``k`` (not measured) every offloaded
    rate is divided by ``n``, as if the DRAM bound every path. Measured on two H200s (13B, a process of 2 GPUs):
    sharing every rate by ``n`` predicted 1.58 s exposed a step where 0.1 s was.
    """
    n, k = self.ranks_per_host, rates.host_kernel
    if n == 1:
      return rates
    if not k:
      backward = None if rates.stream_backward is None else rates.stream_backward / n
      return dataclasses.replace(
        rates, host=rates.host / n, host_concurrent=rates.host_concurrent / n, stream=rates.stream / n,
        stream_concurrent=rates.stream_concurrent / n, stream_backward=backward,
      )  # fmt: skip
    host = 1 / (n / k + max(0.0, 1 / rates.host - 1 / k))
    stream = min(rates.stream, k / (STREAM_DRAM_SHARE * n))
    fits = min(1.0, k / (n * (rates.host_concurrent + STREAM_DRAM_SHARE * rates.stream_concurrent)))
    backward = None if rates.stream_backward is None else min(rates.stream_backward, stream)
    return dataclasses.replace(
      rates, host=host, host_concurrent=min(host, rates.host_concurrent * fits), stream=stream,
      stream_concurrent=min(stream, rates.stream_concurrent * fits), stream_backward=backward, host_kernel=k / n,
    )  # fmt: skip
