"""The moments' format in a checkpoint: recorded on save, converted on restore where the template's differs.

A checkpoint's ``format`` JSON records ``"moments": {"format": "float32" |
"bfloat16" | "int8", "block": <int8 elements per scale>, "version": 1}``
(a checkpoint without it holds float32 moments). Restoring into a template of
the same format (and block) reads the stored bits as they are, each shard
where the template puts it. Restoring into another format reads the stored
moments in their own format, a group of leaves at a time (:func:`reads`, at
most :data:`CONVERT_BYTES` a read), each leaf whole as a numpy array (in
every process), decodes them to float32 and encodes them in the template's
format (``moment_formats``: the rounding of every path, the step count as
the seed) on the host, then puts each process's shards where the template
says (:func:`convert_leaf`): so a conversion restores onto any mesh, in any
number of processes, and holds at most one read beside the restored state. It
says so in a log warning: from float32 to a compact format the moments are
rounded once; from a compact format to float32 they are the decoded values,
exactly; between compact formats, both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_dos.checkpoint import template
from jax_dos.core import moment_formats as mf

VERSION = 1
# Stored bytes of moments one read of a conversion holds (mu and nu of a group of leaves; a larger leaf is read
# alone): a conversion never holds the whole state twice. 2 GiB: a 13B model's float32 moments in about 50 reads.
CONVERT_BYTES = 2 * 2**30
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
  """Moments stored as ``(fmt, block)`` for parameters of ``shapes``, as a tree like ``mu_t``: the stored shapes and
  dtypes, without shardings (a conversion reads them whole, as numpy arrays: :func:`convert_leaf`)."""
  treedef = jax.tree.structure(mu_t)

  def one(shape):
    n = int(np.prod(shape, dtype=np.int64))
    stored = (-(-n // block), block + 4) if fmt == "int8" else tuple(shape)
    return jax.ShapeDtypeStruct(stored, mf.stored_dtype(fmt))

  return jax.tree.unflatten(treedef, [one(s) for s in shapes])


def reads(stored: list[tuple[int, ...]], dtype: np.dtype, limit: int | None = None) -> list[list[int]]:
  """Leaf indices grouped into a conversion's reads, in order. ``stored``: each leaf's stored moment shape (``mu``'s
  and ``nu``'s alike), of ``dtype``. A group reads its leaves' ``mu`` and ``nu``, at most ``limit`` bytes of them
  (default :data:`CONVERT_BYTES`); a leaf larger than that is a group of its own."""
  limit = CONVERT_BYTES if limit is None else limit
  groups: list[list[int]] = []
  size = 0
  for i, shape in enumerate(stored):
    nbytes = 2 * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if not groups or size + nbytes > limit:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += nbytes
  return groups


def convert_leaf(stored: np.ndarray | None, t: Any, shape: tuple[int, ...], source: str, count: int, salt: int) -> Any:
  """One moment (``salt`` 0: mu, 1: nu) of a parameter of ``shape``, read whole as ``stored`` in format ``source``
  (``None`` for a zero-size parameter), in the template ``t``'s format, sharding and memory kind.

  Decoded to float32 and encoded on the host (``moment_formats.host_decode`` and ``host_encode``: the bits of every
  update path, the step ``count`` as the seed), then placed shard by shard: each process puts only the shards of
  its own devices, so the template may span devices of several processes.
  """
  n = int(np.prod(shape, dtype=np.int64))
  if not n:
    out = np.zeros(t.shape, t.dtype)
  else:
    values, target = mf.host_decode(np.asarray(stored), n, source, salt), tree_format(t)[0]
    if target == "float32":
      out = values.reshape(shape)
    else:
      out = mf.host_encode(values, target, float(count % mf.SEED_PERIOD), salt).reshape(t.shape)
  sharding = getattr(t, "sharding", None)
  if sharding is None:
    return out
  return jax.make_array_from_callback(out.shape, sharding, lambda index: out[index])


def say_converted(step: int, source: tuple[str, int], target: tuple[str, int]) -> None:
  """The log line of a converted restore: what changed (in process 0 only)."""
  if target[0] == "float32":
    change = "their stored values, decoded exactly to float32"
  elif source[0] == "float32":
    change = "rounded once from float32"
  else:
    change = "decoded to float32, then rounded once"
  if jax.process_index() != 0:  # said once for the job
    return
  name = lambda f: f[0] + (f" (blocks of {f[1]})" if f[0] == "int8" else "")  # noqa: E731
  log.warning(
    "checkpoint step %d: Adam's moments were saved as %s and are restored as %s, %s; the master weights and the step"
    " count are unchanged.", step, name(source), name(target), change,
  )  # fmt: skip


def read_converted(restore: Callable[..., dict], step: int, t: Any) -> tuple[Any, Any]:
  """Step ``step``'s moments, stored as ``t.source`` (``t``: the restore's ``canonical.DiskTemplate``), in the
  templates' format, shardings and memory kinds: read with ``restore`` (an Orbax ``CheckpointManager.restore``) a
  group of leaves at a time (:func:`reads`) as numpy arrays, whole in every process, each leaf converted on the host
  and put shard by shard where its template says (:func:`convert_leaf`)."""
  canon = template.disk_template(t.canon)  # as on disk: the moments' stored shapes, zero-size leaves' stand-ins
  paths = [path for path, _ in jax.tree.flatten_with_path(canon)[0]]
  first = {k: next(i for i, p in enumerate(paths) if p[0].key == k) for k in ("count", "mu", "nu")}
  templates = [jax.tree.leaves(x) for x in (t.parts.mu, t.parts.nu)]
  stored = [tuple(x.shape) for x in jax.tree.leaves(t.moments[0])]
  out: list[list[Any]] = [[None] * len(stored), [None] * len(stored)]
  for group in reads(stored, mf.stored_dtype(t.source[0])):
    wanted = {first[k] + i for k in ("mu", "nu") for i in group if np.prod(t.shapes[i], dtype=np.int64)}
    wanted.add(first["count"])
    read = restore(step, args=template.ocp.args.Composite(opt_state=template.read_as_numpy(canon, wanted)))
    leaves = jax.tree.leaves(read["opt_state"])
    count = int(leaves[first["count"]])
    for salt, k in enumerate(("mu", "nu")):
      for i in group:
        x = leaves[first[k] + i]
        out[salt][i] = convert_leaf(
          None if x is template.PLACEHOLDER else x, templates[salt][i], t.shapes[i], t.source[0], count, salt
        )
    del read, leaves  # this group's stored moments: freed before the next group is read
  trees = (t.parts.mu, t.parts.nu)
  return tuple(jax.tree.unflatten(jax.tree.structure(tree), leaves) for tree, leaves in zip(trees, out))
