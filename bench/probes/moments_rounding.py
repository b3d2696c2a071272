"""Rounding and block size of compact moments, measured: ``train.gpt`` with one variant of ``moment_formats``.

Usage: ``python bench/probes/moments_rounding.py VARIANT -- <train.gpt arguments>``, VARIANT one of
``stochastic`` (the formats as they are), ``nearest`` (round half up instead of stochastically) or
``block=N`` (int8 blocks of N elements). Variants patch the jnp path only: train with ``--offload device``.
``python bench/probes/moments_rounding.py decay`` prints :func:`decay_probe`'s ``nu`` per rounding instead.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402

from jax_dos.core import moment_formats  # noqa: E402
from train import gpt  # noqa: E402


def patch(variant: str) -> None:
  if variant == "nearest":
    # 0x80008000: u = 0.5 (+2**-17) for int8's floor(x + u); +0x8000 then truncation for bfloat16: round half up.
    moment_formats._uniform = lambda n, seed, salt: jnp.full((n,), 0x80008000, jnp.uint32)
  elif variant.startswith("block="):
    moment_formats.BLOCK = int(variant.split("=")[1])
  elif variant != "stochastic":
    raise SystemExit(f"unknown variant {variant!r}: stochastic, nearest or block=N")


def decay_probe(steps: int = 3000, b2: float = 0.999) -> dict:
  """``nu`` of a block whose gradients fall from 1 to 0.01 at step 100 (one element's stay at 1), per rounding.

  Returns the mean over the fallen elements of ``nu`` at the end, float32 and each format and rounding: round to
  nearest cannot follow a decay of ``1 - b2`` a step where that is under half a code.
  """
  import jax

  g = jnp.ones(256, jnp.float32)
  fallen = g.at[0].set(1.0)
  out = {}
  stochastic = moment_formats._uniform
  nearest = lambda n, seed, salt: jnp.full((n,), 0x80008000, jnp.uint32)  # noqa: E731
  for name, fmt, uniform in [("float32", "float32", stochastic), ("bfloat16-nearest", "bfloat16", nearest),
                             ("bfloat16-stochastic", "bfloat16", stochastic), ("int8-nearest", "int8", nearest),
                             ("int8-stochastic", "int8", stochastic)]:  # fmt: skip
    moment_formats._uniform = uniform

    @jax.jit
    def run(fmt=fmt):
      def body(t, nu):
        grad = jnp.where(t < 100, g, fallen * jnp.where(jnp.arange(256) == 0, 1.0, 0.01))
        v = (1 - b2) * grad**2 + b2 * moment_formats.decode(nu, (256,), fmt, 1)
        return moment_formats.encode(v, fmt, (t + 1).astype(jnp.float32), 1)

      nu0 = moment_formats.encode(jnp.zeros(256, jnp.float32), fmt, jnp.float32(0), 1)
      return moment_formats.decode(jax.lax.fori_loop(0, steps, body, nu0), (256,), fmt, 1)

    out[name] = float(jnp.mean(run()[1:]))
  moment_formats._uniform = stochastic
  return out


if __name__ == "__main__" and sys.argv[1:] == ["decay"]:
  import json

  print(json.dumps(decay_probe(), indent=1))
elif __name__ == "__main__":
  variant, sep, *rest = sys.argv[1:]
  if sep != "--":
    raise SystemExit(__doc__)
  patch(variant)
  gpt.main(rest)
