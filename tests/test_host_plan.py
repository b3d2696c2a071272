"""The pinned host memory of a plan, per process and per host (``jax_dos/planning/host_plan.py``), and XLA's CPU
client's pool (``jax_dos/memory/cpu_client.py``): planned from shapes, nothing allocated."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dos
from jax_dos.memory import cpu_client
from jax_dos.memory.pinned_pool import DEFAULT_POOL_FRACTION
from jax_dos.planning import host_plan
from models import gpt as gpt_model

GIB = 2**30
TWO_H200_HOST = int(251.8 * GIB)  # the two-H200 machine's RAM (BENCHMARKS.md, scale_out)
H100_HOST = 125 * GIB  # the H100 machine's (docs/scaling.md)


def test_the_pool_pins_whole_doubling_regions():
  """Requests that tile every region (a power of two of at most 1 MiB, a random count): the pool pins regions of 2,
  4, 8, ... MiB, the fewest whose sum holds them; under a limit it never pins more than the limit, and refuses
  what does not fit."""
  rng = np.random.default_rng()
  size, count = 2 ** int(rng.integers(8, 21)), int(rng.integers(1, 20_000))
  need = size * count
  regions = 1
  while host_plan.REGION_START * (2**regions - 1) < need:
    regions += 1
  assert host_plan.pool_reserved([size] * count, 1 << 50) == host_plan.REGION_START * (2**regions - 1)
  sizes = [int(s) for s in rng.integers(1, 64 << 20, size=int(rng.integers(1, 200)))]
  total = sum(-(-s // host_plan.ROUNDING) * host_plan.ROUNDING for s in sizes)
  limit = int(total * rng.uniform(1.0, 3.0))
  reserved = host_plan.pool_reserved(sizes, limit)
  assert total <= reserved <= limit or reserved == limit + 1
  assert host_plan.pool_reserved(sizes, total - 1) == total  # short of what they need: refused (limit + 1)


@functools.lru_cache(maxsize=1)
def _gpt13b_on_data2() -> tuple:
  """The 13B model's leaves as each of 2 data-parallel processes holds their partitioned state: half of every leaf
  along the first dimension 2 divides (``partition.state_sharding``'s rule), whole where none does."""

  def half(x):
    d = next((d for d, n in enumerate(x.shape) if n % 2 == 0), None)
    shape = x.shape if d is None else x.shape[:d] + (x.shape[d] // 2,) + x.shape[d + 1 :]
    return jax.ShapeDtypeStruct(shape, x.dtype)

  cfg = gpt_model.get_config("gpt-13b", param_dtype="bfloat16")
  return tuple(half(x) for x in jax.tree.leaves(gpt_model.abstract_params(cfg)))


def test_13b_on_two_h200s_was_killed_by_the_pools_and_fits_with_shared_caps():
  """``--preset gpt-13b --mesh data=2 --offload host`` on two H200s of one 251.8 GiB host (BENCHMARKS.md).

  Each process needs 16 B a parameter of its half (its state check passed). Each pool was capped at 90% of the
  whole host's RAM, and growing by doubling regions it pins more than its need: together more than the RAM (the
  run was killed before its first step). Capped at each process's share, both fit.
  """
  leaves = _gpt13b_on_data2()
  host = jax_dos.HostMemory(TWO_H200_HOST, processes=2)
  plan = host_plan.host_plan(leaves, ["host"] * len(leaves), host)
  assert plan.state_bytes == 16 * sum(math.prod(x.shape) for x in leaves)  # 12 B of state, 4 of host buffers
  assert plan.state_bytes < DEFAULT_POOL_FRACTION * TWO_H200_HOST / 2  # the check at init passed
  whole_host_cap = int(DEFAULT_POOL_FRACTION * TWO_H200_HOST)  # configure_process's cap, in each process
  assert plan.reserved_bytes(whole_host_cap) > plan.state_bytes
  assert plan.host_bytes(whole_host_cap) > TWO_H200_HOST  # killed
  assert plan.fits and plan.refusal() is None
  assert plan.state_bytes <= plan.reserved_bytes() <= plan.share_bytes
  assert plan.host_bytes() <= DEFAULT_POOL_FRACTION * TWO_H200_HOST  # the plan that fits: each pool at its share
  host_plan.check(plan)


def test_a_layout_that_cannot_fit_the_host_is_refused_with_its_numbers():
  """13B on two processes of the 125 GiB H100 host: 94 GiB each against a 56 GiB share."""
  leaves = _gpt13b_on_data2()
  plan = host_plan.host_plan(leaves, ["host"] * len(leaves), jax_dos.HostMemory(H100_HOST, processes=2))
  message = plan.refusal()
  assert not plan.fits and message is not None
  for text in (f"{plan.state_bytes / GIB:.1f} GiB", f"{plan.share_bytes / GIB:.1f} GiB", "125.0 GiB", "2 processes",
               "--moments", "fewer processes", "smaller model", "--offload auto"):  # fmt: skip
    assert text in message, (text, message)
  with pytest.raises(MemoryError, match="does not fit this host's RAM"):
    host_plan.check(plan)
  # on device, the state needs no pinned memory
  assert host_plan.host_plan(leaves, ["device"] * len(leaves), jax_dos.HostMemory(H100_HOST, 2)).fits


def test_the_optimizer_refuses_from_shapes_before_allocating():
  """``get_plan`` on abstract parameters (nothing allocated) refuses a host too small for the host plan, and
  accepts the same tree with the state on the device."""
  rng = np.random.default_rng()
  params = {"w": jax.ShapeDtypeStruct((int(rng.integers(64, 512)), 64), jnp.float32)}
  need = 16 * math.prod(params["w"].shape)
  small = jax_dos.HostMemory(int(need / DEFAULT_POOL_FRACTION * 2 / 3), processes=1)
  tx = jax_dos.interleaved_adam(1e-3, plan="host", host_memory=small)
  with pytest.raises(MemoryError, match="--moments"):
    jax_dos.get_plan(tx, params)
  roomy = jax_dos.HostMemory(int(need / DEFAULT_POOL_FRACTION) * 4, processes=1)
  assert jax_dos.get_plan(jax_dos.interleaved_adam(1e-3, plan="host", host_memory=roomy), params).placements
  assert jax_dos.get_plan(jax_dos.interleaved_adam(1e-3, plan="device", host_memory=small), params).placements


def test_the_cpu_clients_pool_leaves_a_thread_for_every_devices_part():
  """Enough pool threads for every dispatching thread's blocked launches and the running program's parts, plus one;
  one device launches on the caller (no pool needed beyond the cores)."""
  rng = np.random.default_rng()
  devices, cores = int(rng.integers(2, 9)), int(rng.integers(1, 5))
  blocked = (cpu_client.DISPATCHING_THREADS + 1) * devices  # launches on full semaphores and one program's parts
  assert cpu_client.pool_threads(devices, cores) > blocked
  assert cpu_client.pool_threads(1, cores) == cores
  flags = f"--xla_cpu_foo=1 --xla_force_host_platform_device_count={devices} --bar"
  assert cpu_client.forced_cpu_devices(flags) == devices and cpu_client.forced_cpu_devices("") == 1


def test_each_process_pool_is_capped_at_its_share_unless_the_user_set_it():
  """``share_pinned_pool`` (before the backend starts) replaces ``configure_process``'s whole-host cap by the
  process's share; a cap the user set stays."""
  import os
  import subprocess
  import sys

  from jax_dos.memory.pinned_pool import POOL_LIMIT_ENV

  rng = np.random.default_rng()
  host = jax_dos.HostMemory(int(rng.integers(64, 2048)) * GIB, int(rng.integers(2, 9)))
  call = f"jax_dos.share_pinned_pool(jax_dos.HostMemory({host.ram_bytes}, {host.processes}))"
  code = f"import os, jax_dos; jax_dos.configure_process(); {call}; print(os.environ['{POOL_LIMIT_ENV}'])"
  env = {k: v for k, v in os.environ.items() if k != POOL_LIMIT_ENV}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert out.stdout.split() == [str(host_plan.pool_share(host) // GIB)], out.stdout + out.stderr
  out = subprocess.run([sys.executable, "-c", code], env=env | {POOL_LIMIT_ENV: "7"}, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
  assert out.stdout.split() == ["7"], out.stdout + out.stderr


def test_compact_moments_fit_13b_on_the_h100_host_where_float32_is_refused():
  """One process, the whole 13B state streamed (no host-updated buffers): 12 B a parameter does not fit the 125 GiB
  host; int8 moments (about 6 B) do, and the refusal names the format it was planned with."""
  cfg = gpt_model.get_config("gpt-13b", param_dtype="bfloat16")
  leaves = jax.tree.leaves(gpt_model.abstract_params(cfg))
  n = sum(math.prod(x.shape) for x in leaves)
  host = jax_dos.HostMemory(H100_HOST, processes=1)
  plans = {m: host_plan.host_plan(leaves, ["stream"] * len(leaves), host, moments=m) for m in jax_dos.MOMENT_FORMATS}
  assert plans["float32"].state_bytes == 12 * n and not plans["float32"].fits
  assert "--moments bfloat16 or int8" in plans["float32"].refusal()
  assert plans["bfloat16"].state_bytes == 8 * n
  assert plans["int8"].fits and 6 * n < plans["int8"].state_bytes < 6.1 * n
