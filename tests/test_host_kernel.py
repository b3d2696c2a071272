"""The fused host kernel computes adam_math's step on many buffers at once."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dos.core import adam_math
from jax_dos.core import moment_formats as mf
from jax_dos.kernels import host_kernels


def test_many_buffers_match_the_shared_maths():
  rng = np.random.default_rng()
  hyper = adam_math.AdamHyper(3e-3, b1=0.8, b2=0.99, eps=1e-7, eps_root=1e-10, weight_decay=0.05)
  count = jnp.asarray(int(rng.integers(0, 50)), jnp.int32)
  scalars = adam_math.step_scalars(hyper, count)
  sizes = [0, 1, 7, 1000, 262_145]
  decay = [bool(i % 2) for i in range(len(sizes))]
  buffers, expected = [], []
  for n, d in zip(sizes, decay):
    g, p, m = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(n)).astype(np.float32)
    _, p_new, m_new, v_new = adam_math.leaf_update(*(jnp.array(x) for x in (g, p, m, v, p)), scalars, hyper, d)
    # Materialise before the kernel writes p, m, v in place (jax dispatches asynchronously).
    expected.append(tuple(np.array(x) for x in (p_new, m_new, v_new)))
    buffers.append((g, p, m, v))
  host_kernels.adam_many(
    buffers,
    decay,
    b1=hyper.b1,
    b2=hyper.b2,
    eps=hyper.eps,
    eps_root=hyper.eps_root,
    weight_decay=hyper.weight_decay,
    scalars=np.asarray(scalars),
  )
  # Inputs are O(1); differences of an ulp of the operands (XLA may fuse a multiply-add, numba does not)
  # are what float32 rounding allows, also where m cancels to near zero.
  for (_, p, m, v), (p_new, m_new, v_new) in zip(buffers, expected):
    np.testing.assert_allclose(m, m_new, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v, v_new, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(p, p_new, rtol=1e-6, atol=1e-6)


def test_mismatched_buffers_are_refused_before_any_write():
  a, b = np.ones(4, np.float32), np.ones(5, np.float32)
  kw = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, scalars=np.ones(3, np.float32))
  with pytest.raises(ValueError, match="one size"):
    host_kernels.adam_many([(a, a.copy(), a.copy(), b)], [False], **kw)
  with pytest.raises(TypeError, match="float32"):
    host_kernels.adam_many([(a, a.copy(), a.copy(), a.astype(np.float64))], [False], **kw)
  with pytest.raises(ValueError, match="decay flags"):
    host_kernels.adam_many([(a, a.copy(), a.copy(), a.copy())], [], **kw)


def test_bfloat16_gradients_are_widened_exactly():
  """bf16 gradients give the float32 kernel's result on the same (widened) values, bit for bit."""
  rng = np.random.default_rng()
  n = 100_003
  g16 = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
  p, m = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
  v = np.abs(rng.standard_normal(n)).astype(np.float32)
  scalars = np.asarray([-1e-3, 0.1, 0.05], np.float32)
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1, scalars=scalars)
  wide = [np.asarray(g16, np.float32), p.copy(), m.copy(), v.copy()]
  narrow = [np.asarray(g16), p.copy(), m.copy(), v.copy()]
  host_kernels.adam_many([wide], [True], **kw)
  host_kernels.adam_many([narrow], [True], **kw)
  for a, b in zip(wide[1:], narrow[1:]):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(narrow[1], p)


def _awkward_float32(rng, n):
  """Normal samples plus the values rounding to bfloat16 gets wrong most easily: ties, overflow, inf, nan."""
  x = rng.standard_normal(n).astype(np.float32)
  bits = x.view(np.uint32)
  bits[: n // 8] = (bits[: n // 8] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties: round to even
  special = [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, 1.00390625, 1.01171875]
  x[n // 8 : n // 8 + len(special)] = special
  return x


def test_the_bfloat16_copy_of_new_weights_rounds_as_xla_does():
  rng = np.random.default_rng()
  n = 50_001
  g = rng.standard_normal(n).astype(np.float32)
  p = _awkward_float32(rng, n)
  m, v = rng.standard_normal(n).astype(np.float32), np.abs(rng.standard_normal(n)).astype(np.float32)
  low = np.zeros(n, jnp.bfloat16)
  scalars = np.asarray([-1e-3, 0.1, 0.05], np.float32)
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1, scalars=scalars)
  plain = [g, p.copy(), m.copy(), v.copy()]
  host_kernels.adam_many([plain], [True], **kw)
  with_low = [g, p.copy(), m.copy(), v.copy(), low]
  host_kernels.adam_many([with_low], [True], **kw)
  for a, b in zip(plain[1:], with_low[1:4]):
    np.testing.assert_array_equal(a, b)  # the copy changes nothing else
  want = np.asarray(jnp.asarray(with_low[1]).astype(jnp.bfloat16))
  np.testing.assert_array_equal(low.astype(np.float32), want.astype(np.float32))  # (nan == nan here)


def test_round_to_bf16_matches_xla():
  x = _awkward_float32(np.random.default_rng(), 100_003)
  out = np.zeros(x.size, jnp.bfloat16)
  host_kernels.round_to_bf16(out, x)
  want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
  np.testing.assert_array_equal(out.astype(np.float32), want.astype(np.float32))  # (nan == nan here)
  with pytest.raises(TypeError, match="float32 -> bfloat16"):
    host_kernels.round_to_bf16(out, x.astype(np.float64))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
def test_the_moment_copies_are_the_new_moments_in_the_copies_dtype(dtype):
  """Seven buffers: low_m and low_v receive the new m and v, rounded as XLA rounds; nothing else changes."""
  rng = np.random.default_rng()
  n = 40_003
  g = rng.standard_normal(n).astype(np.float32)
  p, m = rng.standard_normal(n).astype(np.float32), _awkward_float32(rng, n)
  v = np.abs(rng.standard_normal(n)).astype(np.float32)
  scalars = np.asarray([-1e-3, 0.1, 0.05], np.float32)
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1, scalars=scalars)
  five = [g, p.copy(), m.copy(), v.copy(), np.zeros(n, dtype)]
  seven = [g, p.copy(), m.copy(), v.copy(), np.zeros(n, dtype), np.zeros(n, dtype), np.zeros(n, dtype)]
  host_kernels.adam_many([five], [True], **kw)
  host_kernels.adam_many([seven], [True], **kw)
  for a, b in zip(five[1:], seven[1:5]):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  for copy, new in ((seven[5], seven[2]), (seven[6], seven[3])):
    want = np.asarray(jnp.asarray(new).astype(dtype))
    np.testing.assert_array_equal(np.asarray(copy, np.float32), np.asarray(want, np.float32))  # (nan == nan here)
  with pytest.raises(TypeError, match="same dtype"):
    host_kernels.adam_many([seven[:5] + [np.zeros(n, np.float32), np.zeros(n, jnp.bfloat16)]], [True], **kw)


_TWO_THREADS = """
import concurrent.futures
import numba
import numpy as np
from jax_dos.core import moment_formats
from jax_dos.kernels import host_kernels

rng = np.random.default_rng()
hyper = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1)
scalars = np.asarray([-1e-3, 0.1, 0.001], np.float32)
state = lambda: [rng.standard_normal(100_003).astype(np.float32) for _ in range(4)]
inputs = [state() for _ in range(2)]
for _, _, _, v in inputs:
  v[:] = np.abs(v)
alone = [[x.copy() for x in s] for s in inputs]
for g, p, m, v in alone:
  for _ in range(20):
    host_kernels.adam_many([(g, p, m, v)], [True], scalars=scalars, **hyper)
codes = moment_formats.host_encode(inputs[0][0], "int8", 3.0, 0)

def run(bufs):
  for _ in range(20):
    host_kernels.adam_many([tuple(bufs)], [True], scalars=scalars, **hyper)

def convert():
  return [moment_formats.host_encode(inputs[0][0], "int8", 3.0, 0) for _ in range(20)]

with concurrent.futures.ThreadPoolExecutor(3) as pool:
  futures = [pool.submit(run, s) for s in inputs] + [pool.submit(convert)]
  converted = [f.result() for f in futures][-1]
for got, want in zip(inputs, alone):
  for x, y in zip(got, want):
    np.testing.assert_array_equal(x, y)
for c in converted:
  np.testing.assert_array_equal(c, codes)
print(numba.threading_layer())
"""


def test_two_threads_launching_at_once_both_finish_with_one_threads_numbers():
  """Two optimizers' host workers step while a checkpoint's moments are converted, on numba's workqueue layer, which
  aborts the process where two threads launch at once: every launch waits for the one running, and each thread's
  numbers are those of one thread alone."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
  out = subprocess.run([sys.executable, "-c", _TWO_THREADS], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "workqueue"


_STEP_ONCE = """
import numpy as np
from jax_dos.kernels import host_kernels
g, p, m, v = (np.ones(64, np.float32) for _ in range(4))
host_kernels.adam_many([(g, p, m, v)], [True], b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1,
                       scalars=np.array([-1e-3, 0.1, 0.001], np.float32))
import numba
print("threading layer", numba.threading_layer())
"""


def test_a_new_interpreter_loads_the_kernel_compiled_here_from_numbas_cache():
  """The kernels are closures over jitted helpers; numba's cache finds them in every process (not compiled again).
  Their first launch selects numba's workqueue layer (``jax_dos.parallel_launch``) where no layer was asked for."""
  exec(_STEP_ONCE, {})  # compiled (or loaded) and cached here
  env = dict(os.environ, NUMBA_DEBUG_CACHE="1")
  env.pop("NUMBA_THREADING_LAYER", None)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  command = [sys.executable, "-c", _STEP_ONCE]
  out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [line for line in out.stdout.splitlines() if "adam_inplace" in line and "data" in line]
  assert lines and all("data loaded" in line for line in lines), out.stdout[-3000:]
  assert "threading layer workqueue" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("moments", ["float32", "bfloat16", "int8"])
def test_subnormals_flush_to_zero_as_xla_on_the_cpu_does(moments):
  """Gradients so small that ``(1 - b2) g^2`` is subnormal: the host kernel's new state equals the jnp path's under
  XLA's CPU backend, which flushes subnormals (bit for bit with compact moments; float32's to an ulp, XLA fusing
  multiply-adds), where keeping them gave nonzero ``nu``; the calling thread's own floating-point mode comes back."""
  rng = np.random.default_rng()
  n = 4099
  hyper = adam_math.AdamHyper(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, moments=moments)
  count = jnp.asarray(int(rng.integers(0, 50)), jnp.int32)
  scalars = adam_math.step_scalars(hyper, count)
  g = (rng.standard_normal(n) * 1e-20).astype(np.float32)
  g[: n // 2] *= np.float32(1e3)  # half of them 1e-17: g^2 normal, (1 - b2) g^2 not
  p = rng.standard_normal(n).astype(np.float32)
  m, v = (mf.host_encode(np.zeros(n, np.float32), moments, 1.0, s) if moments != "float32"
          else np.zeros(n, np.float32) for s in (0, 1))  # fmt: skip
  _, p_new, m_new, v_new = adam_math.leaf_update(*(jnp.asarray(x) for x in (g, p, m, v, p)), scalars, hyper, True)
  expected = [np.array(x) for x in (p_new, m_new, v_new)]
  tiny = jnp.asarray(g[n // 2 :])
  assert not np.any(np.asarray(jnp.float32(1 - hyper.b2) * (tiny * tiny))), "XLA's CPU backend kept subnormals"
  host_kernels.adam_many([(g, p, m, v)], [True], b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root,
                         weight_decay=hyper.weight_decay, scalars=np.asarray(scalars))  # fmt: skip
  np.testing.assert_array_equal(v.view(np.uint8), expected[2].view(np.uint8))
  if moments != "float32":
    np.testing.assert_array_equal(m.view(np.uint8), expected[1].view(np.uint8))
  np.testing.assert_allclose(p, expected[0], rtol=1e-6, atol=1e-7)
  assert np.float32(1e-36) * np.float32(1e-3) != 0  # numpy in this thread still makes subnormals
