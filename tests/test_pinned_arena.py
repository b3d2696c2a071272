"""Pinned host memory of our own (``jax_dos.memory.pinned_arena``) and the copies into it (``jax_dos.memory.copy_out``).

The CPU backend takes the same DLPack path as CUDA (``kDLCUDAHost`` arrays in ``pinned_host`` memory), so these
run the arena's code as the GPU does; only the driver's copy (``cuMemcpyDtoHAsync``) is ``memmove`` here.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dos.hand_off import HandOffError
from jax_dos.memory.copy_out import CopyOut
from jax_dos.memory.pinned_arena import PinnedArena


def _device_array(rng: np.random.Generator, shape, dtype=jnp.float32) -> jax.Array:
  return jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype))


def test_arena_arrays_are_pinned_zero_copy_and_read_by_programs():
  rng = np.random.default_rng()
  arena = PinnedArena(jax.devices()[:1], chunk_bytes=1 << 20)
  like = _device_array(rng, (64, 32))
  a = arena.zeros_like(like)
  assert a.sharding.memory_kind == "pinned_host" and a.shape == like.shape and a.dtype == like.dtype
  assert not np.asarray(a).any()  # fresh pages are zero
  host = np.asarray(like)
  view = np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * a.nbytes).from_address(a.unsafe_buffer_pointer()),
                       np.float32).reshape(a.shape)  # fmt: skip
  view[:] = host  # written in place, as the host kernel does
  on_device = jax.device_put(a, a.sharding.with_memory_kind("device"))
  np.testing.assert_array_equal(np.asarray(on_device), host)
  device = a.sharding.with_memory_kind("device")
  total = jax.jit(lambda x: jnp.sum(jax.device_put(x, device)), in_shardings=a.sharding)(a)  # read as the step's are
  # float32 sums of both signs: the rounding is relative to the sum of magnitudes, not to the sum (near 0 at times)
  np.testing.assert_allclose(float(total), host.sum(dtype=np.float64), rtol=1e-5, atol=2e-6 * np.abs(host).sum())
  assert arena.owns(a) and not arena.owns(on_device)


def test_freed_slots_are_reused_and_cleared_on_request():
  rng = np.random.default_rng()
  arena = PinnedArena(jax.devices()[:1], chunk_bytes=1 << 20)
  like = _device_array(rng, (100, 7))
  copier = CopyOut()
  a = copier.submit([like], [arena.array_like(like)]).result().take()[0]
  copier.close()
  np.testing.assert_array_equal(np.asarray(a), np.asarray(like))
  address = a.unsafe_buffer_pointer()
  arena.free(a)
  assert a.is_deleted() and not arena.owns(a)
  b = arena.array_like(like)  # the same slot, holding what it held
  assert b.unsafe_buffer_pointer() == address
  np.testing.assert_array_equal(np.asarray(b), np.asarray(like))
  arena.free(b)
  c = arena.zeros_like(like)
  assert c.unsafe_buffer_pointer() == address and not np.asarray(c).any()
  with pytest.raises(ValueError, match="live array of this arena"):
    arena.free(like)


def test_slots_larger_than_a_chunk_and_chunks_filled_in_turn():
  arena = PinnedArena(jax.devices()[:1], chunk_bytes=1 << 16)
  big = arena.zeros_like(jax.ShapeDtypeStruct((1 << 15,), jnp.float32, sharding=_single()))  # 128 KiB: its own chunk
  small = [arena.zeros_like(jax.ShapeDtypeStruct((1000,), jnp.float32, sharding=_single())) for _ in range(20)]
  assert big.nbytes == 1 << 17 and all(not np.asarray(x).any() for x in small)
  assert arena.mapped_bytes == (1 << 17) + 2 * (1 << 16)  # 20 slots of 4 KiB in two chunks of 64 KiB


def _single() -> jax.sharding.SingleDeviceSharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_copy_out_writes_device_arrays_into_arena_arrays_in_order():
  rng = np.random.default_rng()
  arena = PinnedArena(jax.devices()[:1], chunk_bytes=1 << 20)
  copier = CopyOut()
  try:
    srcs = [_device_array(rng, (33, 5)), _device_array(rng, (8,), jnp.bfloat16)]
    expected = [np.asarray(s) for s in srcs]
    dsts = [arena.array_like(s) for s in srcs]
    done = copier.submit([s * 2 for s in srcs], dsts, free_sources=True)  # sources still being computed
    given = done.result(timeout=60)
    out = given.take()  # the destinations, handed back: taken once
    assert out == dsts
    with pytest.raises(HandOffError, match="taken already"):
      given.take()
    for got, want in zip(out, expected):
      np.testing.assert_array_equal(np.asarray(got), want * 2)
    with pytest.raises(ValueError, match="equal dtypes and shapes"):
      copier.submit([srcs[0]], [dsts[1]])
  finally:
    copier.close()


SHARDED = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_dos.memory.copy_out import CopyOut
    from jax_dos.memory.pinned_arena import PinnedArena

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng()
    copier = CopyOut()
    arena = PinnedArena(jax.devices(), chunk_bytes=1 << 16)
    for spec in (P("data", "model"), P("data"), P()):
      x = jax.device_put(jnp.asarray(rng.standard_normal((8, 6)), jnp.float32), NamedSharding(mesh, spec))
      a = copier.submit([x], [arena.array_like(x)]).result().take()[0]
      assert a.sharding.memory_kind == "pinned_host", a.sharding
      assert a.sharding.with_memory_kind("device").is_equivalent_to(x.sharding, 2), a.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(x))
      back = jax.device_put(a, a.sharding.with_memory_kind("device"))
      np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
      doubled = jax.jit(lambda h: h * 2, out_shardings=x.sharding)(back)
      np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(x))
    copier.close()
    print("sharded ok")
  """
)


def test_sharded_arena_arrays_on_four_devices(four_devices):
  out = four_devices.run(SHARDED, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "sharded ok" in out.stdout


def test_small_slots_leave_the_large_ones_packed():
  """Norms and biases among the matrices: the small slots go to chunks of their own, so eight 2 MiB slots fill two
  chunks of 8 MiB exactly (among them, each 4 KiB slot would leave a gap just short of the next large one)."""
  arena = PinnedArena(jax.devices()[:1], chunk_bytes=8 << 20)
  small, large = (jax.ShapeDtypeStruct((n,), jnp.float32, sharding=_single()) for n in (1024, 1 << 19))
  arrays = [arena.zeros_like(x) for _ in range(8) for x in (small, large)]
  assert arena.live_bytes == 8 * (small.size + large.size) * 4
  assert arena.mapped_bytes == 2 * (8 << 20) + (8 << 20)  # two chunks of large slots, one of small ones
  assert all(not np.asarray(a).any() for a in arrays[:4])
