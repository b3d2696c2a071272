"""The moments' format in a checkpoint: recorded on save, converted on restore where the template's differs.

A checkpoint's ``format`` JSON records ``"moments": {"format": "float32" |
"bfloat16" | "int8", "block": <int8 elements per scale>, "version": 1}``
(a checkpoint without it holds float32 moments). Restoring into a template of
the same format (and block) reads the stored bits as they are. Restoring into
another format reads the stored moments in their own format, decodes them to
float32 and encodes them in the template's (``moment_formats``: the rounding
of every path, the step count as the seed), on the host, and says so in a log
warning: from float32 to a compact format the moments are rounded once; from a
compact format to float32 they are the decoded values, exactly; between
compact formats, both.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jax_dos import moment_formats as mf

VERSION = 1
log = logging.getLogger("jax_dos.checkpoint")


def _leaf_format(x: Any) -> tuple[str, int] | None:
  """``(format, block)`` of one stored moment leaf (``None`` for a zero-size one, which tells nothing)."""
  if 0 in tuple(x.shape):
    return None
  dtype = str(x.dtype)
  if dtype == "uint8":
    return "int8", int(x.shape[-1]) - 4
  return {"float32": "float32", "bfloat16": "bfloat16"}[dtype], 0


def tree_format(mu: Any) -> tuple[str, int]:
  """``(format, block)`` of a tree of moments (``("float32", 0)`` for a tree of empty leaves)."""
  found = {f for f in map(_leaf_format, jax.tree.leaves(mu)) if f is not None}
  if len(found) > 1:
    raise ValueError(f"the moments mix formats {sorted(found)}; an optimizer stores all of them in one.")
  return found.pop() if found else ("float32", 0)


def record(mu: Any) -> dict:
  """What a checkpoint's ``format`` JSON says of the moments ``mu`` (and ``nu``, stored alike)."""
  fmt, block = tree_format(mu)
  return {"format": fmt, "block": block, "version": VERSION}


def saved(fmt_json: dict) -> tuple[str, int]:
  """``(format, block)`` a checkpoint's ``format`` JSON records (float32 where it records nothing)."""
  moments = fmt_json.get("moments", {"format": "float32", "block": 0, "version": VERSION})
  if moments.get("version", VERSION) > VERSION:
    raise ValueError(
      f"the checkpoint stores its moments in version {moments['version']} of their format; this jax_dos reads"
      f" version {VERSION}. Restore with a newer jax_dos."
    )
  return moments["format"], int(moments.get("block", 0))


def disk_template(mu_t: Any, shapes: list[tuple[int, ...]], fmt: str, block: int) -> Any:
  """Templates of moments stored as ``(fmt, block)`` for parameters of ``shapes``, placed as ``mu_t``'s leaves."""
  leaves, treedef = jax.tree.flatten(mu_t)

  def one(t, shape):
    n = int(np.prod(shape, dtype=np.int64))
    stored = (-(-n // block), block + 4) if fmt == "int8" else tuple(shape)
    sharding = getattr(t, "sharding", None)
    if sharding is not None and fmt == "int8":
      sharding = jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)), memory_kind=sharding.memory_kind)
    return jax.ShapeDtypeStruct(stored, mf.stored_dtype(fmt), sharding=sharding)

  return jax.tree.unflatten(treedef, [one(t, s) for t, s in zip(leaves, shapes)])


def convert(
  restored: Any, mu_t: Any, shapes: list[tuple[int, ...]], source: tuple[str, int], count: int, salt: int
) -> Any:
  """Moments ``restored`` in ``source`` format as the template ``mu_t``'s format and placement (on the host)."""
  leaves, treedef = jax.tree.flatten(mu_t)
  target = tree_format(mu_t)[0]
  out = []
  for x, t, shape in zip(jax.tree.leaves(restored), leaves, shapes):
    n = int(np.prod(shape, dtype=np.int64))
    if not isinstance(x, np.ndarray) and not x.is_fully_addressable:
      raise ValueError("converting moments between formats on restore needs arrays this process holds whole.")
    values = mf.host_decode(np.asarray(x), n, source[0], salt) if n else np.zeros(0, np.float32)
    if target == "float32":
      stored = values.reshape(shape)
    elif n:
      stored = mf.host_encode(values, target, float(count % mf.SEED_PERIOD), salt).reshape(t.shape)
    else:
      stored = np.zeros(t.shape, t.dtype)
    sharding = getattr(t, "sharding", None)
    out.append(jax.device_put(stored, sharding) if sharding is not None else stored)
  return jax.tree.unflatten(treedef, out)


def say_converted(step: int, source: tuple[str, int], target: tuple[str, int]) -> None:
  """The log line of a converted restore: what changed."""
  if target[0] == "float32":
    change = "their stored values, decoded exactly to float32"
  elif source[0] == "float32":
    change = "rounded once from float32"
  else:
    change = "decoded to float32, then rounded once"
  name = lambda f: f[0] + (f" (blocks of {f[1]})" if f[0] == "int8" else "")  # noqa: E731
  log.warning(
    "checkpoint step %d: Adam's moments were saved as %s and are restored as %s, %s; the master weights and the step"
    " count are unchanged.", step, name(source), name(target), change,
  )  # fmt: skip
