"""How Adam's moments are stored: float32, bfloat16, or 8-bit codes with a float32 scale per block.

The fp32 master weights are never compact; only ``mu`` and ``nu`` are. Every
path (the host kernel in numba, the streamed, resident and traced updates in
jnp) decodes a moment to float32, takes AdamW's step in float32
(``adam_math.py``) and encodes the new moment with the functions here, so a
change of plan changes nothing: both implementations give identical bits
(``tests/test_moment_formats.py``).

``"float32"``: the moments as they are (optax's numbers).

``"bfloat16"``: each moment rounded to bfloat16, **stochastically**: the
float32 bits plus 16 random bits, truncated to the top 16 (NaN kept quiet).
Round-to-nearest cannot represent ``nu``'s decay: ``b2 nu`` differs from
``nu`` by 0.1 % (``b2 = 0.999``), under half a bfloat16 ulp (0.2-0.4 %), so
a nearest-rounded ``nu`` never decreases (docs/design.md, the measurement).

``"int8"``: each leaf's moments, flattened and zero-padded to whole blocks of
``BLOCK`` elements, are stored as one ``uint8`` array of shape
``(blocks, BLOCK + 4)`` holding, in order, every block's ``BLOCK`` codes, then
every block's float32 scale (4 bytes, little-endian): element ``i``'s code is
byte ``i``, so the host kernel indexes codes as it indexes the weights (its
loops vectorize). The block size is the shape's second dimension less 4.
The maps are non-linear (square-root companding), so
that small moments keep relative precision (a linear map of ``nu`` sends
small ones to 0, and ``m / sqrt(nu)`` to infinity)::

    mu:  s = max |m|        q = sign(m) R(127 sqrt(|m| (1/s)))    m = T_mu[q] s,           T_mu[q] = sign(q) (q / 127)^2
    nu:  s = sqrt(max v)    q = R(255 sqrt(sqrt(v) (1/s)))        v = (T_nu[q] s)^2,       T_nu[q] = (q / 255)^2

(``q`` int8 for mu, uint8 for nu; the tables ``T`` are float32, rounded once
from the exact values.)

``nu``'s code is at least 1 where ``v > 0``: a nonzero ``nu`` never decodes to
0 (which would make the step ``m / eps``). ``R`` rounds stochastically,
``floor(x + u)`` with ``u`` uniform in ``[0, 1)``: as with bfloat16, rounding
to nearest freezes a moment that moves by less than half a code a step.

The random bits are a hash (murmur3's finalizer) of the element's index in
its leaf, the step (``count + 1``, modulo ``2**24``, carried as the fifth step
scalar) and the moment (0: mu, 1: nu), so they do not depend on the plan, the
path or the thread. All arithmetic is IEEE float32 (divide, multiply,
square root: correctly rounded on every backend), in the order written here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numba
import numba.extending
import numpy as np

from jax_dos.memory import kinds as memory
from jax_dos.parallel_launch import one_launch_at_a_time

FORMATS = ("float32", "bfloat16", "int8")
BLOCK = 256  # int8 elements per float32 scale; docs/design.md says why
SEED_PERIOD = 2**24  # the step seed is carried as an exact float32
_C_IDX, _C_SEED, _C_SALT = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_MASK = 0xFFFFFFFF
_Q = np.arange(256, dtype=np.uint8)
# The decoded values of a code at scale 1, rounded once to float32 (indexed by the code's byte). The jnp paths look
# them up (XLA would turn a division by 127**2 into a multiply); the host kernel computes them (``nb_mu_decode``: a
# multiply and a fused multiply-add, the tables' bits for every code, tested), which vectorizes where a lookup does
# not.
MU_TABLE = (np.sign(_Q.view(np.int8)) * (_Q.view(np.int8).astype(np.float64) / 127) ** 2).astype(np.float32)
NU_TABLE = ((_Q.astype(np.float64) / 255) ** 2).astype(np.float32)


def check(moments: Any) -> str:
  """``moments`` if it names a format, else a ``ValueError`` naming the three."""
  if not isinstance(moments, str) or moments not in FORMATS:
    raise ValueError(
      f"moments must be one of {FORMATS} (how Adam's mu and nu are stored beside the float32 master: 'float32' is"
      f" optax's numbers, 'bfloat16' 8 B a parameter in all, 'int8' about 6 B), got {moments!r}."
    )
  return moments


def stored_dtype(moments: str) -> np.dtype:
  return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16), "int8": np.dtype(np.uint8)}[moments]


def stored_shape(shape: tuple[int, ...], moments: str) -> tuple[int, ...]:
  """The shape a moment of a leaf of ``shape`` is stored in."""
  if moments != "int8":
    return tuple(shape)
  return (blocks(math.prod(shape)), BLOCK + 4)


def blocks(n: int) -> int:
  return -(-n // BLOCK)


def bytes_per_moment(moments: str) -> float:
  """Bytes one moment of one parameter takes in ``moments`` (the int8 scale shared by its block)."""
  return {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / BLOCK}[moments]


def state_bytes_per_param(moments: str) -> float:
  """Host state bytes a parameter: the float32 master and two moments (12, 8, about 6)."""
  return 4.0 + 2 * bytes_per_moment(moments)


def zero_moment_like(x: Any, kind: str, moments: str) -> jax.Array:
  """A zero moment (all-zero bits in every format) for a parameter like ``x``, in memory ``kind``.

  An int8 moment is one ``(blocks, BLOCK + 4)`` array, not laid out like ``x``: ``x`` must live on one device.
  """
  if moments != "int8":
    return memory.zeros_like_in(x, kind, stored_dtype(moments))
  if memory.is_traced(x):
    return memory.traced_put(jnp.zeros(stored_shape(jnp.shape(x), moments), jnp.uint8), kind)
  st = moment_struct(x, moments)
  return memory._zeros_fn(st.shape, st.dtype, st.sharding.with_memory_kind(kind))()


def moment_struct(x: Any, moments: str) -> jax.ShapeDtypeStruct:
  """The shape, dtype and sharding (in accelerator memory) of a moment of a parameter like ``x``
  (:func:`zero_moment_like`'s)."""
  shape = stored_shape(tuple(jnp.shape(x)), moments)
  sharding = memory.sharding_of(x).with_memory_kind("device")
  if moments == "int8":
    if len(sharding.device_set) > 1:
      raise ValueError(
        f"moments='int8' keeps each leaf's moments whole on one device, but a leaf of shape {jnp.shape(x)} spans"
        f" {len(sharding.device_set)} devices. Use moments='bfloat16' (laid out as the parameters) on a mesh."
      )
    sharding = jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
  return jax.ShapeDtypeStruct(shape, stored_dtype(moments), sharding=sharding)


def step_seed(count_inc: jax.Array) -> jax.Array:
  """The step's seed as float32 (exact): ``(count + 1) mod 2**24``."""
  return (count_inc % SEED_PERIOD).astype(jnp.float32)


# ----------------------------------------------------------------------------- jnp (device paths)


def _key(seed: jax.Array, salt: int) -> jax.Array:
  s = seed.astype(jnp.int32).astype(jnp.uint32)
  return s * jnp.uint32(_C_SEED) + jnp.uint32((salt * _C_SALT) & _MASK)


def _uniform(n: int, seed: jax.Array, salt: int) -> jax.Array:
  """The ``n`` random uint32 of elements ``0..n-1`` of a leaf."""
  h = jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(_C_IDX) + _key(seed, salt)
  h = h ^ (h >> 16)
  h = h * jnp.uint32(_M1)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(_M2)
  return h ^ (h >> 16)


def _unit(bits: jax.Array) -> jax.Array:
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def encode(x: jax.Array, moments: str, seed: jax.Array, salt: int) -> jax.Array:
  """A float32 moment (``salt`` 0: mu, 1: nu) in its stored form; ``seed`` from :func:`step_seed`."""
  if moments == "float32":
    return x
  n = x.size
  bits = _uniform(n, seed, salt)
  if moments == "bfloat16":
    xb = jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint32)
    nan = (xb & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
    out = jnp.where(nan, (xb >> 16) | jnp.uint32(0x40), (xb + (bits & jnp.uint32(0xFFFF))) >> 16)
    return jax.lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16).reshape(x.shape)
  nb = blocks(n)
  pad = nb * BLOCK - n
  xf = jnp.pad(x.reshape(-1), (0, pad)).reshape(nb, BLOCK)
  u = _unit(jnp.pad(bits, (0, pad))).reshape(nb, BLOCK)
  if salt == 0:
    a = jnp.abs(xf)
    s = jnp.max(a, axis=1, keepdims=True)
    q = _round(jnp.sqrt(a * (1 / s)) * jnp.float32(127), u, 127)
    codes = jax.lax.bitcast_convert_type(jnp.where(xf < 0, -q, q).astype(jnp.int8), jnp.uint8)
  else:
    s = jnp.sqrt(jnp.max(xf, axis=1, keepdims=True))  # = max sqrt(v): sqrt is monotone and correctly rounded
    q = _round(jnp.sqrt(jnp.sqrt(xf) * (1 / s)) * jnp.float32(255), u, 255)
    q = jnp.where(xf > 0, jnp.maximum(q, 1), q)
    codes = q.astype(jnp.uint8)
  scale = jax.lax.bitcast_convert_type(s, jnp.uint8).reshape(-1)
  return jnp.concatenate([codes.reshape(-1), scale]).reshape(nb, BLOCK + 4)


def _round(x: jax.Array, u: jax.Array, top: int) -> jax.Array:
  """``min(floor(x + u), top)`` as int32, 0 where ``x`` is not a number >= 0 (NaN, from a 0 or NaN scale)."""
  ok = x >= 0
  q = (jnp.where(ok, x, 0) + u).astype(jnp.int32)  # >= 0: truncation is floor
  return jnp.where(ok, jnp.minimum(q, top), 0)


def decode(stored: jax.Array, shape: tuple[int, ...], moments: str, salt: int) -> jax.Array:
  """A stored moment (``salt`` 0: mu, 1: nu) as float32 of ``shape``."""
  if moments == "float32":
    return stored
  if moments == "bfloat16":
    return stored.astype(jnp.float32)
  nb, block = stored.shape[0], stored.shape[1] - 4  # BLOCK, or the block of a checkpoint being converted
  flat = stored.reshape(-1)
  codes = flat[: nb * block].reshape(nb, block)
  s = jax.lax.bitcast_convert_type(flat[nb * block :].reshape(nb, 4), jnp.float32)[:, None]
  if salt == 0:
    x = jnp.asarray(MU_TABLE)[codes] * s
  else:
    t = jnp.asarray(NU_TABLE)[codes] * s
    x = t * t
  return x.reshape(-1)[: math.prod(shape)].reshape(shape)


# ----------------------------------------------------------------------------- numba (the host kernel)
# The same maths on one element (bfloat16) or one block (int8), for host_compact.py's kernels.


def host_key(seed: float, salt: int) -> np.uint32:
  """:func:`_key` for the host: the seed as the kernel receives it (a float32 step scalar). A uint32: a kernel
  given a 64-bit key and narrowing it inside its loop ran the bfloat16 step at half the rate (``nb_hash``)."""
  return np.uint32((int(seed) * _C_SEED + salt * _C_SALT) & _MASK)


_U16, _U13, _U8 = np.uint32(16), np.uint32(13), np.uint32(8)


@numba.njit(inline="always")
def nb_hash(i, key):
  """:func:`_uniform`'s uint32 of element ``i``, in 32-bit lanes: each product and sum cast back to uint32 (numba
  widens uint32 arithmetic to 64 bits; masked 64-bit lanes halved the vector width, and the bfloat16 kernel's rate)."""
  return nb_fmix(nb_seed(i, key))


@numba.njit(inline="always")
def nb_seed(i, key):
  """The hash's input ``i C + key`` (mod 2**32): ``nb_hash(i, key) = nb_fmix(nb_seed(i, key))``, and element
  ``i + 1``'s is ``C`` more, an induction a loop adds up in vector lanes (``host_compact``'s int8 kernel)."""
  return np.uint32(np.uint32(i) * np.uint32(_C_IDX) + np.uint32(key))


@numba.njit(inline="always")
def nb_fmix(h):
  """murmur3's finalizer of the uint32 ``h``."""
  h = np.uint32(h ^ (h >> _U16))
  h = np.uint32(h * np.uint32(_M1))
  h = np.uint32(h ^ (h >> _U13))
  h = np.uint32(h * np.uint32(_M2))
  return np.uint32(h ^ (h >> _U16))


@numba.njit(inline="always")
def nb_unit(h):  # through int32: a uint32 -> float conversion does not vectorize
  return np.float32(np.int32(h >> _U8)) * np.float32(2.0**-24)


@numba.njit(inline="always")
def nb_bf16_load(bits):
  return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit(inline="always")
def nb_bf16_store(x, h):  # stochastic rounding with the random bits h (a uint32)
  bits = np.float32(x).view(np.uint32)
  # NaN (one unordered compare): its top 16 bits, quieted (bit 22 set); else the bits plus 16 random ones (no carry
  # out of 32 bits: only a NaN's bits lie that high), both shifted once.
  wide = (bits | np.uint32(0x400000)) if x != x else np.uint32(bits + (np.uint32(h) & np.uint32(0xFFFF)))
  return np.uint16(wide >> _U16)


@numba.njit(inline="always")
def nb_round(x, u, top):
  q = np.int32(x + u) if x >= np.float32(0) else np.int32(0)  # x + u >= 0: truncation is floor; NaN: 0
  return min(q, np.int32(top))


@numba.extending.intrinsic
def nb_fma(typingctx, a, b, c):
  """``a b + c`` of three float32, rounded once (IEEE's fused multiply-add: LLVM's ``llvm.fma``, one instruction on a
  CPU with FMA, which every AVX2 one has)."""
  f32 = numba.types.float32
  if (a, b, c) != (f32, f32, f32):
    return None

  def codegen(context, builder, signature, args):
    return builder.fma(*args)

  return f32(f32, f32, f32), codegen


# 1 / 127**2 and 1 / 255**2 as a float32 (HI) and the float32 of the rest (LO). For a code's k = q |q| (q**2),
# fma(k, HI, k LO) rounds k HI + RN(k LO), which lies within 2**-47 (relatively) of k / 127**2, once: to the nearest
# float32 of the exact quotient, the table's value, as no code's quotient lies that near a midpoint between float32s
# (all 256 codes tested). A float32 multiply and multiply-add in vector lanes, where the float64 multiply they
# replaced took two conversions each way.
_MU_HI, _NU_HI = np.float32(1 / 127**2), np.float32(1 / 255**2)
_MU_LO, _NU_LO = np.float32(1 / 127**2 - float(_MU_HI)), np.float32(1 / 255**2 - float(_NU_HI))


@numba.njit(inline="always")
def nb_mu_decode(byte, s):  # byte: the code's uint8 bits
  q = np.int32(np.int8(byte))
  k = np.float32(np.int32(q * abs(q)))  # exact: |k| <= 2**14
  return nb_fma(k, _MU_HI, k * _MU_LO) * s  # MU_TABLE[byte] * s


@numba.njit(inline="always")
def nb_mu_code(m, inv, u):  # inv: 1 / the block's scale
  q = nb_round(np.sqrt(abs(m) * inv) * np.float32(127), u, 127)
  return np.uint8(np.int32(-q) if m < np.float32(0) else q)  # the int8 code's two's-complement byte


@numba.njit(inline="always")
def nb_nu_decode(code, s):
  q = np.int32(code)
  k = np.float32(np.int32(q * q))  # exact: k < 2**16
  t = nb_fma(k, _NU_HI, k * _NU_LO) * s  # NU_TABLE[code] * s
  return t * t


@numba.njit(inline="always")
def nb_nu_code_of_root(r, v, inv, u):  # nb_nu_code(v, inv, u) given r = sqrt(v)
  q = nb_round(np.sqrt(r * inv) * np.float32(255), u, 255)
  if v > np.float32(0) and q < 1:
    q = np.int32(1)
  return np.uint8(q)


@numba.njit(inline="always")
def nb_nu_code(v, inv, u):  # inv: 1 / the block's scale
  return nb_nu_code_of_root(np.sqrt(v), v, inv, u)


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _nb_encode(x, key, salt, fmt_int8, out16, codes, words):
  n = x.shape[0]
  if not fmt_int8:
    for i in numba.prange(n):
      out16[i] = nb_bf16_store(x[i], nb_hash(i, key))
    return
  nb = (n + BLOCK - 1) // BLOCK
  for b in numba.prange(nb):  # each block reads its elements and writes its codes and its scale only
    lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
    s, bad = np.float32(0), False
    for i in range(lo, hi):
      s = max(s, abs(x[i]) if salt == 0 else x[i])
      bad |= x[i] != x[i]
    s = np.float32(np.nan) if bad else s if salt == 0 else np.sqrt(s)
    inv = np.float32(1) / s
    for i in range(lo, hi):
      u = nb_unit(nb_hash(i, key))
      if salt == 0:
        codes[i] = nb_mu_code(x[i], inv, u)
      else:
        codes[i] = nb_nu_code(x[i], inv, u)
    words[nb * (BLOCK // 4) + b] = s


def _read_only(x: np.ndarray) -> np.ndarray:
  """A read-only view of ``x``: the numba functions' inputs always read-only, given read-only or not, so that each is
  compiled for one set of argument types (numba compiles a function again for a read-only array)."""
  x = x.view()
  x.flags.writeable = False
  return x


@one_launch_at_a_time
def host_encode(x: np.ndarray, moments: str, seed: float, salt: int) -> np.ndarray:
  """:func:`encode` by the host kernel's numba functions (one flat float32 array), on all cores: the same bits (each
  element's random bits are a hash of its index, each int8 block's scale its own elements')."""
  x = _read_only(np.ascontiguousarray(x, np.float32).reshape(-1))
  out = np.zeros(stored_shape(x.shape, moments), stored_dtype(moments))
  bf16 = moments == "bfloat16"
  flat = out.reshape(-1).view(np.uint16 if bf16 else np.uint8)
  none16, none8, none32 = np.zeros(0, np.uint16), np.zeros(0, np.uint8), np.zeros(0, np.float32)
  _nb_encode(x, host_key(seed, salt), salt, not bf16, flat if bf16 else none16, none8 if bf16 else flat,
             none32 if bf16 else flat.view(np.float32))  # fmt: skip
  return out


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _nb_decode(n, salt, fmt_int8, bits16, codes8, words, out, block):
  if not fmt_int8:
    for i in numba.prange(n):
      out[i] = nb_bf16_load(bits16[i])
    return
  nb = (n + block - 1) // block
  scales = nb * (block // 4)  # the blocks' scales follow their codes
  for b in numba.prange(nb):  # a block's scale read once, no branch in the element loops
    s, lo, hi = words[scales + b], b * block, min(n, (b + 1) * block)
    if salt == 0:
      for i in range(lo, hi):
        out[i] = nb_mu_decode(codes8[i], s)
    else:
      for i in range(lo, hi):
        out[i] = nb_nu_decode(codes8[i], s)


@one_launch_at_a_time
def host_decode(stored: np.ndarray, n: int, moments: str, salt: int) -> np.ndarray:
  """:func:`decode` by the host kernel's numba functions, on all cores, as a flat float32 array of ``n``: the same
  bits; float32 moments as they are (a view of ``stored`` where it is float32 already: read it, do not write it).

  An int8 moment's block is its row's length less 4 (so a checkpoint's other block size decodes too).
  """
  if moments == "float32":
    return np.asarray(stored, np.float32).reshape(-1)[:n]
  bf16 = moments == "bfloat16"
  block = 0 if bf16 else int(np.shape(stored)[-1]) - 4
  flat = _read_only(np.ascontiguousarray(stored).reshape(-1).view(np.uint16 if bf16 else np.uint8))
  out = np.empty(n, np.float32)
  none16, none8, none32 = (_read_only(np.zeros(0, t)) for t in (np.uint16, np.uint8, np.float32))
  _nb_decode(n, salt, not bf16, flat if bf16 else none16, none8 if bf16 else flat,
             none32 if bf16 else flat.view(np.float32), out, block)  # fmt: skip
  return out


# ----------------------------------------------------------------------------- whole arrays (conversions)


def to_float32(stored: Any, shape: tuple[int, ...], moments: str, salt: int) -> jax.Array:
  """A stored moment (``salt`` 0: mu, 1: nu) as a float32 array of ``shape`` (on its device; XLA)."""
  return decode(jnp.asarray(stored), tuple(shape), moments, salt)


def from_float32(x: Any, moments: str, seed: int, salt: int) -> jax.Array:
  """A float32 moment in ``moments``' stored form, rounded with step ``seed``'s random bits (XLA)."""
  return encode(jnp.asarray(x, jnp.float32), moments, jnp.float32(seed % SEED_PERIOD), salt)
