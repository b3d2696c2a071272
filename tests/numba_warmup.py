"""Fills numba's cache with every host kernel the tests run, before any test starts (``conftest.pytest_configure``).

``python tests/numba_warmup.py SHARE`` compiles (or loads, where cached) its share of the kernels: ``conftest`` starts
shares 0 and 1 side by side, one a core, and waits for both. Without it, the processes that first need a kernel each
compile it: pytest-xdist's two workers, and the two processes of each multi-process test (in a run with a cold cache,
both processes of a pair wrote the same kernels within half a second of each other), 3-12 s of a core each time. Every
kernel is called on a few elements through the public entry points, as the tests and the engine call it, so it is
compiled for the argument types they pass (one signature each: ``host_kernels._flat_all``); the shares balance their
compile times on a cold cache (int8 and bfloat16 moments' kernels about 10 s and 7 s each, float32's 3-6 s).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

N = 300  # a partial int8 block


def _hyper(scalars):
  return dict(b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1, scalars=np.float32(scalars))


def _vector(dtype):
  return np.ones(N, dtype)


def float32_state(grad, low) -> None:
  from jax_dos.kernels import host_kernels

  g, state, copy = _vector(grad), [_vector(np.float32) for _ in range(3)], _vector(low)
  host_kernels.adam_many([(g, *state, copy)], [True], **_hyper([-1e-3, 0.1, 0.01, 1.0]))


def float32_into(grad, low) -> None:
  from jax_dos.kernels import host_kernels

  g, state, copy = _vector(grad), [_vector(np.float32) for _ in range(6)], _vector(low)
  host_kernels.adam_many_into([(g, *state, copy)], [True], **_hyper([-1e-3, 0.1, 0.01, 1.0]))


def compact(moments, grad, low) -> None:
  from jax_dos.core import moment_formats as mf
  from jax_dos.kernels import host_kernels

  g, p, copy = _vector(grad), _vector(np.float32), _vector(low)
  # Zeros, not host_encode's moments: the other share compiles host_encode, once.
  m, v = (np.zeros(mf.stored_shape((N,), moments), mf.stored_dtype(moments)) for _ in range(2))
  host_kernels.adam_many([(g, p, m, v, copy)], [True], **_hyper([-1e-3, 0.1, 0.01, 1.0, 3.0]))


def others() -> None:
  import jax.numpy as jnp

  from jax_dos.core import moment_formats as mf
  from jax_dos.kernels import host_kernels
  from jax_dos.memory import host_copies

  for low in (ml_dtypes.bfloat16, np.float32):
    host_kernels.predict_many([(_vector(low), *(_vector(np.float32) for _ in range(3)))], [True], eps=1e-8,
                              eps_root=0.0, weight_decay=0.1, scalars=np.float32([-1e-3, 0.1, 0.01]))  # fmt: skip
  host_kernels.round_to_bf16(_vector(ml_dtypes.bfloat16), _vector(np.float32))
  host_copies.snapshot(jnp.ones(N))
  mf.host_decode(mf.host_encode(_vector(np.float32), "int8", 1.0, 0), N, "int8", 0)


BF16, F32 = ml_dtypes.bfloat16, np.float32
SHARES = (
  [lambda g=g, lo=lo: compact("int8", g, lo) for g in (F32, BF16) for lo in (BF16, F32)]
  + [lambda: float32_state(F32, BF16)],
  [lambda g=g, lo=lo: compact("bfloat16", g, lo) for g in (F32, BF16) for lo in (BF16, F32)]
  + [lambda g=g, lo=lo: float32_state(g, lo) for g, lo in ((BF16, BF16), (F32, F32), (BF16, F32))]
  + [others]
  + [lambda g=g, lo=lo: float32_into(g, lo) for g in (F32, BF16) for lo in (BF16, F32)],
)


if __name__ == "__main__":
  for call in SHARES[int(sys.argv[1])]:
    call()
