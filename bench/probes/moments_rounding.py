"""Rounding and block size of compact moments, measured: ``train.gpt`` with one variant of ``moment_formats``.

Usage: ``python bench/probes/moments_rounding.py VARIANT -- <train.gpt arguments>``, VARIANT one of
``stochastic`` (the formats as they are), ``nearest`` (round half up instead of stochastically) or
``block=N`` (int8 blocks of N elements). Variants patch the jnp path only: train with ``--offload device``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402

from jax_dos import moment_formats  # noqa: E402
from train import gpt  # noqa: E402


def patch(variant: str) -> None:
  if variant == "nearest":
    # 0x80008000: u = 0.5 (+2**-17) for int8's floor(x + u); +0x8000 then truncation for bfloat16: round half up.
    moment_formats._uniform = lambda n, seed, salt: jnp.full((n,), 0x80008000, jnp.uint32)
  elif variant.startswith("block="):
    moment_formats.BLOCK = int(variant.split("=")[1])
  elif variant != "stochastic":
    raise SystemExit(f"unknown variant {variant!r}: stochastic, nearest or block=N")


if __name__ == "__main__":
  variant, sep, *rest = sys.argv[1:]
  if sep != "--":
    raise SystemExit(__doc__)
  patch(variant)
  gpt.main(rest)
