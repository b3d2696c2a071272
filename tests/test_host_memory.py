"""Host memory bounded before jax starts: XLA's pinned pool capped from the run's need, a run too large refused."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dos
from jax_dos.memory import host_ram, pinned_pool
from jax_dos.memory.pinned_pool import BFC_TABLE_FRACTION
from jax_dos.overlap import memory as overlap_memory
from jax_dos.overlap import plan as overlap_plan
from models import gpt as gpt_model
from train import host_memory
from train.flags import parse_args

GiB = 2**30

CAP = textwrap.dedent(
  """
    import math, os, sys
    import jax_dos
    from jax_dos.memory import pinned_pool

    need, ram = int(sys.argv[1]), int(sys.argv[2])
    env = pinned_pool.POOL_LIMIT_ENV
    assert env not in os.environ  # importing jax_dos sets nothing
    jax_dos.configure_process()
    assert os.environ[env] == pinned_pool._our_pool_limit  # configure_process's cap: 90% of RAM
    os.environ[env] = "50"  # a value the user set is kept
    assert jax_dos.cap_pinned_pool(need, host_memory_bytes=ram) is None and os.environ[env] == "50"
    os.environ[env] = pinned_pool._our_pool_limit
    cap = jax_dos.cap_pinned_pool(need, host_memory_bytes=ram)
    assert not pinned_pool._backends_started()
    print(cap, os.environ[env])
  """
)


def test_the_pinned_pool_is_capped_from_the_need_before_jax_starts():
  """Before the backend starts, the pool's cap is the need and its margin (never below XLA's 64 GiB, never above the
  RAM less the headroom), replacing the cap ``jax_dos.configure_process`` set; a user's value is kept; once jax has
  started, nothing changes."""
  rng = np.random.default_rng()
  ram = int(rng.integers(100, 200)) * GiB
  need = int(rng.integers(70 * GiB, ram - host_ram.HOST_HEADROOM_BYTES - pinned_pool.POOL_MARGIN_BYTES))
  env = {k: v for k, v in os.environ.items() if k != pinned_pool.POOL_LIMIT_ENV}
  root = Path(__file__).resolve().parent.parent
  out = subprocess.run([sys.executable, "-c", CAP, str(need), str(ram)], cwd=root, env=dict(env, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  cap, value = out.stdout.split()
  gib = math.ceil((need + pinned_pool.POOL_MARGIN_BYTES) / GiB)
  assert int(cap) == gib * GiB and value == str(gib)
  jnp.zeros(1).block_until_ready()  # this process's backend has started
  before = os.environ.get(pinned_pool.POOL_LIMIT_ENV)
  assert jax_dos.cap_pinned_pool(need, host_memory_bytes=ram) is None
  assert os.environ.get(pinned_pool.POOL_LIMIT_ENV) == before


def test_a_run_that_cannot_fit_the_hosts_ram_stops_before_anything_moves():
  """``--offload host`` puts the whole state on the host: a host whose RAM cannot hold it and the process's headroom
  stops the run before jax starts, with the numbers and what to change; a larger host takes it."""
  args_list = ["--preset", "gpt-6.7b", "--offload", "host", "--overlap", "off"]
  args = parse_args(args_list)
  n = gpt_model.param_count(gpt_model.get_config("gpt-6.7b"))
  certain, most = host_memory.pinned_need(args)
  assert certain == 12 * n and most == 16 * n  # the state; and a gradient or weight copy each, on the plain step
  small = certain + host_ram.HOST_HEADROOM_BYTES - int(np.random.default_rng().integers(1, GiB))
  with pytest.raises(SystemExit) as e:
    host_memory.cap_host_memory(args, host_memory_bytes=small)
  message = str(e.value)
  assert f"{certain / GiB:.1f} GiB" in message and f"{small / GiB:.1f} GiB of RAM" in message
  assert "--preset" in message and "--offload" in message
  jax.devices()  # the backend started (as it has when other tests ran first): a run that fits sets no cap then
  assert host_memory.cap_host_memory(args, host_memory_bytes=4 * small) is None
  auto = parse_args(["--preset", "gpt-6.7b"])  # a plan may keep state resident: nothing is certain
  assert host_memory.pinned_need(auto, small)[0] == 0
  int8 = parse_args([*args_list, "--moments", "int8"])
  state = jax_dos.state_bytes_per_param("int8")  # about 6 B a parameter: the float32 master and two 8-bit moments
  assert host_memory.pinned_need(int8) == (math.ceil(state * n), math.ceil((state + 4) * n))


def test_the_need_bound_is_an_all_host_overlapped_plans_need():
  """``host_need_bound`` for the overlapped step is what ``OverlappedStep.host_bytes`` counts for an all-host plan
  (the most per parameter), held to the host budget; for the plain step, 16 B a parameter, counted beside the
  overlapped step's only where the plain step fits the host."""
  rng = np.random.default_rng()
  sizes = [(int(rng.integers(2, 9)), int(rng.integers(2, 9))) for _ in range(3)]
  groups = [{"w": jnp.zeros(s, jnp.bfloat16)} for s in sizes]
  stages = [jax_dos.Stage(lambda p, x, b: x, (g,)) for g in range(len(groups))]
  tx = jax_dos.interleaved_adam(1e-3, plan="host", subgroup_size=8)
  plan = jax_dos.overlapped_plan(tx, stages, groups)
  layout = overlap_plan.step_layout(jax_dos.StagedModel(stages, len(groups)), groups, 8)
  n = sum(math.prod(s) for s in sizes)
  assert jax_dos.host_need_bound(n, 2, overlapped=True, host_memory_bytes=2**50) == overlap_memory.host_bytes(
    plan, layout, 0
  )
  ram = 100 * GiB
  assert jax_dos.host_need_bound(5 * 10**9, 2, overlapped=True, host_memory_bytes=ram) == max(
    16 * 5 * 10**9, int(overlap_memory.HOST_SHARE * ram)
  )
  assert jax_dos.host_need_bound(n) == 16 * n
  big = int(ram / 16)  # the plain step's 16 B a parameter fill the RAM: only the overlapped step can run
  assert jax_dos.host_need_bound(big, 2, overlapped=True, host_memory_bytes=ram) == int(overlap_memory.HOST_SHARE * ram)
  assert jax_dos.host_need_bound(big, 2, overlapped=False, host_memory_bytes=ram) == 16 * big


def test_the_resident_estimate_holds_the_pool_xla_opens_and_its_allocators_tables(monkeypatch):
  """XLA's pinned pool opens regions of 2 MiB doubling up to its cap: the estimate holds the regions a need opens (its
  whole cap once the need passes the regions before the last), 1/32 of them and of the accelerator's pool in XLA's
  tables (under jax's default BFC allocator), and the process's own bytes."""
  monkeypatch.delenv(pinned_pool.ALLOCATOR_ENV, raising=False)
  rng = np.random.default_rng()
  # the 64 GiB region the last the cap cuts: a cap of 128 GiB would hold every region whole (2 MiB short of it)
  cap, accelerator = int(rng.integers(70, 128)) * GiB, int(rng.integers(10, 150)) * GiB
  mib = 2**20
  before_last = 64 * GiB - 2 * mib  # 2 MiB + 4 MiB + ... + 32 GiB: the regions below a 64 GiB one
  rest = pinned_pool.PROCESS_BYTES + accelerator * BFC_TABLE_FRACTION
  above = 128 * GiB - 2 * mib  # under a cap above it, a need past 64 GiB opens the whole 64 GiB region and no more
  large = int(rng.integers(before_last + 1, min(cap, above)))
  assert jax_dos.resident_estimate(large, cap, accelerator) == int(cap * (1 + BFC_TABLE_FRACTION) + rest)
  big_cap = int(rng.integers(129, 400)) * GiB
  assert jax_dos.resident_estimate(large, big_cap, accelerator) == int(above * (1 + BFC_TABLE_FRACTION) + rest)
  small = int(rng.integers(2 * mib + 1, 6 * mib))  # opens the first two regions: 6 MiB
  assert jax_dos.resident_estimate(small, cap, accelerator) == int(6 * mib * (1 + BFC_TABLE_FRACTION) + rest)
  assert jax_dos.resident_estimate(0, cap, accelerator) == int(rest)


@pytest.mark.parametrize("allocator", ["cuda_async", "platform"])
def test_an_accelerator_allocator_without_a_table_adds_none_to_the_resident_estimate(monkeypatch, allocator):
  """Under CUDA's own allocators (what ``train.gpt`` sets), the accelerator's pool keeps no table in host memory."""
  rng = np.random.default_rng()
  cap, accelerator = int(rng.integers(70, 129)) * GiB, int(rng.integers(10, 150)) * GiB
  need = int(rng.integers(65, 69)) * GiB
  monkeypatch.setenv(pinned_pool.ALLOCATOR_ENV, allocator)
  without = jax_dos.resident_estimate(need, cap, accelerator)
  monkeypatch.setenv(pinned_pool.ALLOCATOR_ENV, "bfc")
  assert jax_dos.resident_estimate(need, cap, accelerator) - without == int(accelerator * BFC_TABLE_FRACTION)
  opened = 128 * GiB - 2 * 2**20  # a need over 64 GiB opens XLA's regions of 2 MiB to 64 GiB, unless the cap cuts them
  assert without == int(min(cap, opened) * (1 + BFC_TABLE_FRACTION) + pinned_pool.PROCESS_BYTES)


def test_pinned_memory_of_our_own_counts_at_its_size_beside_the_pool(monkeypatch):
  """Bytes in the step's own mapping (``outside_pool``) count once, with no region rounding and no table; only the rest
  opens XLA's regions."""
  monkeypatch.setenv(pinned_pool.ALLOCATOR_ENV, "cuda_async")
  rng = np.random.default_rng()
  cap, accelerator = int(rng.integers(70, 129)) * GiB, int(rng.integers(10, 150)) * GiB
  need = int(rng.integers(65, 110)) * GiB + int(rng.integers(0, GiB))
  assert jax_dos.resident_estimate(need, cap, accelerator, outside_pool=need) == need + pinned_pool.PROCESS_BYTES
  small = int(rng.integers(2 * 2**20 + 1, 6 * 2**20))  # opens XLA's first two regions: 6 MiB
  in_pool = int(6 * 2**20 * (1 + BFC_TABLE_FRACTION))
  estimate = jax_dos.resident_estimate(need + small, cap, accelerator, outside_pool=need)
  assert estimate == need + in_pool + pinned_pool.PROCESS_BYTES
