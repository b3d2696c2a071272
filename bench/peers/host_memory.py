"""Host memory each peer needs, estimated from the model's shapes before anything is allocated; the check that refuses.

Pure Python (no torch), so the estimates and the refusal can be tested anywhere. ``N`` is the parameter count, shapes
are those of :func:`param_shapes` (the torch GPT's parameters, in ``named_parameters`` order).

* **ZeRO-2 offload** (DeepSpeed 0.19.8 ``stage_1_and_2.py``, ``offload_optimizer: cpu, pin_memory: true``): the fp32
  master partition and the fp32 gradient partition of each parameter group, each one flat page-locked buffer that
  torch's pinned allocator rounds up to a power of two; ``exp_avg`` and ``exp_avg_sq`` (8 B/param, pageable); with
  gradient accumulation, one page-locked accumulation buffer per parameter (counted at 4 B/param, each rounded up).
  At 6.7B: 32 + 32 + 49.6 GiB = 113.6 GiB for 16 x 1 (the measured RSS), about 141 GiB for 8 x 2 (measured: ~145).
* **ZeRO-3 offload with** ``ratio`` (TwinFlow): ``4 + 16 ratio`` bytes per parameter (measured at 6.7B, ratio 0.75:
  89 GiB RSS against 99 GiB estimated).
* **torchao** ``CPUOffloadOptimizer`` (``torchao/optim/cpu_offload.py``): every parameter of at least
  ``minimal_size`` (4096) elements gets a page-locked host copy and a page-locked host gradient of the parameter's
  dtype (``empty_like(..., pin_memory=True)``, each rounded up to a power of two), and its own ``torch.optim.AdamW``
  whose ``exp_avg``/``exp_avg_sq`` have the parameter's dtype (pageable). bf16 parameters: about 8 B/param.
* **torch** (everything on the accelerator): nothing but the process itself.

Every estimate adds :data:`PROCESS_BYTES` for the process (torch, the CUDA context, the libraries).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

GIB = 2**30
PROCESS_BYTES = 5 * GIB  # torch + CUDA context + DeepSpeed/torchao imports, measured RSS before the model: 3-5 GiB
RESERVE_BYTES = 2 * GIB  # left to the kernel and everything else on the machine
TORCHAO_MINIMAL_SIZE = 4096  # CPUOffloadOptimizer's default: smaller tensors stay on the accelerator
SYSTEMS = ("zero2", "zero3", "torchao", "torch")

Shape = tuple[int, ...]


def param_shapes(cfg: Any) -> list[Shape]:
  """Shapes of the torch GPT's parameters for a ``models.gpt.GPTConfig`` (torch layout: Linear weights ``[out, in]``).

  Token and position embeddings, then per block ``ln1, qkv, proj, ln2, fc, mlp proj`` (weight, then bias), then the
  final norm; the head is tied to the token embedding. A LayerNorm with bias has a weight and a bias, an RMSNorm (or
  a LayerNorm without bias) a weight only.
  """
  d = cfg.d_model

  def norm() -> list[Shape]:
    return [(d,), (d,)] if (cfg.norm == "layernorm" and cfg.bias) else [(d,)]

  def linear(d_in: int, d_out: int) -> list[Shape]:
    return [(d_out, d_in), (d_out,)] if cfg.bias else [(d_out, d_in)]

  block = norm() + linear(d, 3 * d) + linear(d, d) + norm() + linear(d, 4 * d) + linear(4 * d, d)
  return [(cfg.vocab_size, d), (cfg.block_size, d)] + block * cfg.n_layer + norm()


def numel(shape: Shape) -> int:
  return math.prod(shape)


def pinned_bytes(nbytes: int) -> int:
  """Bytes torch's caching host allocator takes for a page-locked request: the next power of two."""
  return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def decay_split(shapes: Sequence[Shape]) -> tuple[int, int]:
  """Elements of the two parameter groups: decayed (matrices, embeddings: ``ndim >= 2``) and not (norms, biases)."""
  decay = sum(numel(s) for s in shapes if len(s) >= 2)
  return decay, sum(numel(s) for s in shapes) - decay


def zero2_bytes(shapes: Sequence[Shape], grad_accum: int, ranks: int = 1) -> int:
  """ZeRO-2 with the optimizer offloaded to page-locked host memory (see the module docstring): one process's, of
  ``ranks`` data-parallel processes that each hold ``1 / ranks`` of every group's flat partition."""
  groups = [-(-n // ranks) for n in decay_split(shapes) if n]
  n = sum(groups)
  flat = sum(2 * pinned_bytes(4 * g) for g in groups)  # fp32 master and fp32 gradient partition per group
  accum = sum(pinned_bytes(4 * -(-numel(s) // ranks)) for s in shapes) if grad_accum > 1 else 0
  return PROCESS_BYTES + flat + 8 * n + accum


def zero3_bytes(shapes: Sequence[Shape], ratio: float, ranks: int = 1) -> int:
  """ZeRO-3 with the optimizer states of a ``ratio`` of the sub-groups on the host: ``4 + 16 ratio`` B/param, of a
  process's ``1 / ranks`` share."""
  if not 0.0 <= ratio <= 1.0:
    raise ValueError(f"offload ratio must be in [0, 1], got {ratio}.")
  return PROCESS_BYTES + int((4 + 16 * ratio) * sum(numel(s) for s in shapes) / ranks)


def torchao_bytes(shapes: Sequence[Shape], itemsize: int, minimal_size: int = TORCHAO_MINIMAL_SIZE) -> int:
  """torchao's CPUOffloadOptimizer with AdamW on parameters of ``itemsize`` bytes (2 for bf16, 4 for fp32)."""
  host = [numel(s) * itemsize for s in shapes if numel(s) >= minimal_size]
  return PROCESS_BYTES + sum(2 * pinned_bytes(b) + 2 * b for b in host)  # param + grad pinned; exp_avg, exp_avg_sq


def estimate(
  system: str, shapes: Sequence[Shape], *, grad_accum: int = 1, ratio: float = 0.75, itemsize: int = 2, ranks: int = 1
) -> int:
  """Host bytes one process of ``system`` needs for a model of these parameter shapes, of ``ranks`` data-parallel
  processes (DeepSpeed partitions its offloaded state over them; torchao and torch run one process)."""
  if system == "zero2":
    return zero2_bytes(shapes, grad_accum, ranks)
  if system == "zero3":
    return zero3_bytes(shapes, ratio, ranks)
  if system == "torchao":
    return torchao_bytes(shapes, itemsize)
  if system == "torch":
    return PROCESS_BYTES
  raise ValueError(f"unknown system {system!r}; choose one of {SYSTEMS}.")


def host_limit(meminfo: str, cgroup_max: str | None) -> int:
  """Bytes this process may use: the cgroup's ``memory.max`` where it is set, else ``MemTotal``.

  ``meminfo`` is the text of ``/proc/meminfo``; ``cgroup_max`` that of ``/sys/fs/cgroup/memory.max`` (``"max"`` when
  unlimited) or None. On some multi-GPU machines ``MemTotal`` starts small and grows, while the cgroup limit does not.
  """
  if cgroup_max is not None and cgroup_max.strip() not in ("", "max"):
    return int(cgroup_max.strip())
  for line in meminfo.splitlines():
    if line.startswith("MemTotal:"):
      return int(line.split()[1]) * 1024
  raise ValueError("no MemTotal line in /proc/meminfo")


def read_host_limit() -> int:
  """:func:`host_limit` of this machine."""
  with open("/proc/meminfo") as f:
    meminfo = f.read()
  cgroup = None
  if os.path.exists("/sys/fs/cgroup/memory.max"):
    with open("/sys/fs/cgroup/memory.max") as f:
      cgroup = f.read()
  return host_limit(meminfo, cgroup)


def refusal(system: str, need: int, limit: int, hint: str) -> str | None:
  """None when ``need`` bytes fit in ``limit`` less :data:`RESERVE_BYTES`; else the message that refuses the run."""
  if need <= limit - RESERVE_BYTES:
    return None
  return (
    f"{system} needs about {need / GIB:.1f} GiB of host memory, but this machine allows {limit / GIB:.1f} GiB"
    f" ({RESERVE_BYTES / GIB:.0f} GiB kept free). {hint}"
  )


def hint(system: str, batch: int, grad_accum: int) -> str:
  """What to change when ``system`` does not fit."""
  if system == "zero2" and grad_accum > 1:
    return (
      f"ZeRO-2 keeps a host accumulation buffer per parameter: run the same tokens per step as one micro-batch"
      f" (--batch {batch * grad_accum} --grad-accum 1, or --host-fallback), or a smaller --preset."
    )
  if system == "zero3":
    return "Lower --ratio (fewer sub-groups on the host, more accelerator memory), or a smaller --preset."
  if system == "torchao":
    return "Use bf16 parameters (--torchao-master bf16), or a smaller --preset."
  return "Use a smaller --preset."
