"""Compact moments (``moments="bfloat16" | "int8"``): one rounding on every path, close to float32 Adam."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SHAPES, random_tree

import jax_dos
from jax_dos.core import moment_formats as mf

SHAPES_BLOCKS = dict(SHAPES, big=(40, 17))  # 680 elements: three int8 blocks, the last one padded
LR, STEPS = 1e-2, 6
# A step moves a weight by at most about lr; a decoded moment is off by under one code (bfloat16: 2**-7 of it;
# int8: 2/127 of it at the top of its block, for mu's square-root map). Allow 8 such errors per step.
TOL = {"bfloat16": 8 * 2**-7, "int8": 8 * 2 / 127}


def _moment_samples(rng, n, salt):
  x = rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n))
  x = (x * x if salt else x).astype(np.float32)
  x[rng.integers(0, n, 20)] = 0.0
  x[-300:] = 0.0  # a whole zero block (scale 0)
  return x


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
def test_host_and_jnp_encode_and_decode_to_the_same_bits(moments):
  rng = np.random.default_rng()
  n = 1000
  for salt in (0, 1):
    x = _moment_samples(rng, n, salt)
    seed = float(rng.integers(1, mf.SEED_PERIOD))
    host = mf.host_encode(x, moments, seed, salt)
    dev = np.asarray(mf.encode(jnp.asarray(x), moments, jnp.float32(seed), salt))
    np.testing.assert_array_equal(host.view(np.uint8), dev.view(np.uint8))
    back = np.asarray(mf.decode(jnp.asarray(dev), (n,), moments, salt))
    np.testing.assert_array_equal(mf.host_decode(host, n, moments, salt).view(np.uint32), back.view(np.uint32))
    # Within one code: bfloat16's ulp; int8's at a quarter of its block's maximum or more (code >= 63 for mu).
    block_max = np.repeat(np.maximum.reduceat(np.abs(x), np.arange(0, n, mf.BLOCK)), mf.BLOCK)[:n]
    big = np.abs(x) >= 0.25 * block_max if moments == "int8" else x != 0
    np.testing.assert_allclose(back[big], x[big], rtol=2**-7 if moments == "bfloat16" else 2 / 63)
    assert np.all((back == 0) == (x == 0)) if salt == 1 else True  # a nonzero nu never decodes to 0


def test_the_host_kernel_decodes_every_code_as_the_tables_do():
  """The host kernel computes the decode tables (a quotient, rounded once: moment_formats.nb_mu_decode); the jnp
  paths look them up. At scale 1 the decoded values are the tables' (squared for nu)."""
  stored = np.zeros((1, mf.BLOCK + 4), np.uint8)
  stored[0, :256] = np.arange(256)
  for scale in (np.float32(1), np.float32(np.random.default_rng().uniform(0.5, 2))):
    stored[0, mf.BLOCK :] = np.frombuffer(scale.tobytes(), np.uint8)
    for salt in (0, 1):
      host = mf.host_decode(stored, 256, "int8", salt)
      np.testing.assert_array_equal(
        host.view(np.uint32), np.asarray(mf.decode(jnp.asarray(stored), (256,), "int8", salt)).view(np.uint32)
      )
  stored[0, mf.BLOCK :] = np.frombuffer(np.float32(1).tobytes(), np.uint8)
  np.testing.assert_array_equal(mf.host_decode(stored, 256, "int8", 0).view(np.uint32), mf.MU_TABLE.view(np.uint32))
  np.testing.assert_array_equal(mf.host_decode(stored, 256, "int8", 1), mf.NU_TABLE * mf.NU_TABLE)


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
@pytest.mark.parametrize("into", [False, True], ids=["in_place", "into"])
def test_the_host_kernel_is_decode_float32_adam_encode(moments, into):
  """Bit for bit: the fused kernel equals host_decode, AdamW in numpy float32 (optax's order), host_encode."""
  from jax_dos.core import adam_math
  from jax_dos.kernels import host_kernels

  rng = np.random.default_rng()
  n, f = 5 * mf.BLOCK + 37, np.float32
  hyper = adam_math.AdamHyper(1e-2, b1=0.8, b2=0.99, eps=1e-7, eps_root=1e-10, weight_decay=0.1, moments=moments)
  sc = np.asarray(adam_math.step_scalars(hyper, jnp.asarray(int(rng.integers(0, 10**6)), jnp.int32), 0.7))
  g, p = (rng.standard_normal(n).astype(f) for _ in range(2))
  g[: mf.BLOCK] = 0  # a zero block: scale 0
  m, v = _moment_samples(rng, n, 0), _moment_samples(rng, n, 1)
  seed = float(rng.integers(1, mf.SEED_PERIOD))
  mm, vv = mf.host_encode(m, moments, seed, 0), mf.host_encode(v, moments, seed, 1)
  m_old, v_old = mf.host_decode(mm, n, moments, 0), mf.host_decode(vv, n, moments, 1)
  gs = g * sc[3]
  m_new = f(1 - hyper.b1) * gs + f(hyper.b1) * m_old
  v_new = f(1 - hyper.b2) * (gs * gs) + f(hyper.b2) * v_old
  u = (m_new / sc[1]) / (np.sqrt(v_new / sc[2] + f(hyper.eps_root)) + f(hyper.eps)) + f(hyper.weight_decay) * p
  p_new = p + sc[0] * u
  kw = dict(
    b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root, weight_decay=hyper.weight_decay, scalars=sc
  )
  low = np.zeros(n, jnp.bfloat16)
  if into:
    out = (np.zeros_like(p), np.zeros_like(mm), np.full_like(vv, 7))
    host_kernels.adam_many_into([(g, p, mm, vv, *out, low)], [True], **kw)
  else:
    out = (p, mm, vv)
    host_kernels.adam_many([(g, p, mm, vv, low)], [True], **kw)
  np.testing.assert_array_equal(out[0], p_new)
  np.testing.assert_array_equal(low, p_new.astype(jnp.bfloat16))
  np.testing.assert_array_equal(_bytes(out[1]), _bytes(mf.host_encode(m_new, moments, float(sc[4]), 0)))
  np.testing.assert_array_equal(_bytes(out[2]), _bytes(mf.host_encode(v_new, moments, float(sc[4]), 1)))


# Lengths around the int8 block (256) and the kernels' spans (4096): one element, partial and whole blocks, a last
# span that is one block and a bit.
KERNEL_LENGTHS = (1, 255, 256, 257, 3 * 4096 + 256 + 37)


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
@pytest.mark.parametrize("grad", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["state", "state_low16", "state_low32", "low16", "into32"])
def test_the_host_kernel_gives_the_jnp_paths_bits_for_every_flag(moments, grad, mode):
  """Bit for bit against code that shares nothing with the kernel: the jnp path's decode and encode and AdamW in
  numpy float32, for each set of flags the kernel has a loop for, both gradient dtypes, decay on and off, lengths
  around the blocks, zero blocks and moments far apart in size."""
  from jax_dos.core import adam_math
  from jax_dos.kernels import host_kernels

  rng = np.random.default_rng()
  f = np.float32
  hyper = adam_math.AdamHyper(1e-2, b1=0.8, b2=0.99, eps=1e-7, eps_root=1e-10, weight_decay=0.1, moments=moments)
  sc = np.asarray(adam_math.step_scalars(hyper, jnp.asarray(int(rng.integers(0, 10**6)), jnp.int32), 0.7))
  seed = float(rng.integers(1, mf.SEED_PERIOD))
  bufs, want = [], []
  for j, n in enumerate(KERNEL_LENGTHS):
    g = (rng.standard_normal(n) * np.exp(3 * rng.standard_normal(n))).astype(f)
    g[: min(n, mf.BLOCK)] *= j % 2  # a zero block of gradients in every other buffer
    if grad == "bfloat16":
      g = g.astype(jnp.bfloat16)
    p = rng.standard_normal(n).astype(f)
    mm, vv = (mf.from_float32(_moment_samples(rng, n + 300, salt)[300:], moments, seed, salt) for salt in (0, 1))
    mm, vv = np.array(mm), np.array(vv)
    m_old, v_old = (np.asarray(mf.decode(jnp.asarray(x), (n,), moments, salt)) for salt, x in enumerate((mm, vv)))
    gs = g.astype(f) * sc[3]
    m_new = f(1 - hyper.b1) * gs + f(hyper.b1) * m_old
    v_new = f(1 - hyper.b2) * (gs * gs) + f(hyper.b2) * v_old
    u = (m_new / sc[1]) / (np.sqrt(v_new / sc[2] + f(hyper.eps_root)) + f(hyper.eps))
    if j % 2:  # decay
      u = u + f(hyper.weight_decay) * p
    p_new = p + sc[0] * u
    low = np.full(n, 3, jnp.bfloat16 if mode.endswith("16") else f)
    if mode.startswith("into"):
      bufs.append((g, p, mm, vv, np.full_like(p, 5), np.full_like(mm, 7), np.full_like(vv, 9), low))
    else:
      bufs.append((g, p, mm, vv) if mode == "state" else (g, p, mm, vv, low))
    new_state = (p_new, *(mf.from_float32(x, moments, float(sc[4]), salt) for salt, x in enumerate((m_new, v_new))))
    old_state = (p.copy(), mm.copy(), vv.copy())
    want.append((new_state if mode != "low16" else old_state, p_new.astype(low.dtype)))
  kw = dict(b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root, weight_decay=hyper.weight_decay,
            scalars=sc)  # fmt: skip
  decay = [bool(j % 2) for j in range(len(bufs))]
  if mode.startswith("into"):
    host_kernels.adam_many_into(bufs, decay, **kw)
  else:
    host_kernels.adam_many(bufs, decay, **kw, write_state=mode != "low16")
  for b, ((p_new, m_new, v_new), low) in zip(bufs, want):
    state = b[4:7] if mode.startswith("into") else b[1:4]
    for got, expected in zip(state, (p_new, m_new, v_new)):
      np.testing.assert_array_equal(_bytes(got), _bytes(expected))
    if mode != "state":
      np.testing.assert_array_equal(_bytes(b[-1]), _bytes(low))


@pytest.mark.xdist_group("int8_roots_after")  # one worker compiles the roots_first=False kernel (about 12 s), once
@pytest.mark.parametrize("mode", ["state", "state_low16", "low16"])
def test_the_int8_kernels_split_without_roots_first_gives_the_same_bits(mode, monkeypatch):
  """host_compact.make_int8_kernel(roots_first=False) (nu's square root and scale in the second pass, the split
  bench/probes/host_kernel_bound.py times beside the default) against the default, byte for byte: NaN, inf and zero
  gradients, zero blocks, moments far apart in size, a partial last block."""
  from jax_dos.core import adam_math
  from jax_dos.kernels import host_compact, host_kernels

  rng = np.random.default_rng()
  f, n = np.float32, 3 * 4096 + 256 + 37
  hyper = adam_math.AdamHyper(1e-2, b1=0.8, b2=0.99, eps=1e-7, eps_root=1e-10, weight_decay=0.1, moments="int8")
  sc = np.asarray(adam_math.step_scalars(hyper, jnp.asarray(int(rng.integers(0, 10**6)), jnp.int32), 0.7))
  g = (rng.standard_normal(n) * np.exp(3 * rng.standard_normal(n))).astype(f)
  g[: mf.BLOCK] = 0
  g[[300, 301, 5000]] = [np.nan, np.inf, -np.inf]
  p = rng.standard_normal(n).astype(f)
  seed = float(rng.integers(1, mf.SEED_PERIOD))
  mm, vv = (np.array(mf.from_float32(_moment_samples(rng, n, salt), "int8", seed, salt)) for salt in (0, 1))
  kw = dict(b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root, weight_decay=hyper.weight_decay,
            scalars=sc, write_state=mode != "low16")  # fmt: skip
  outs = []
  for roots_first in (True, False):
    if not roots_first:
      kernel = host_compact.make_int8_kernel(host_kernels._load_f32, host_kernels._bf16_bits, roots_first=False)
      monkeypatch.setitem(host_kernels._COMPACT, ("int8", "float32", "bfloat16"), kernel)
    bufs = (g, p.copy(), mm.copy(), vv.copy()) + (() if mode == "state" else (np.zeros(n, jnp.bfloat16),))
    host_kernels.adam_many([bufs], [True], **kw)
    outs.append(bufs[1:])
  for a, b in zip(*outs):
    np.testing.assert_array_equal(_bytes(a), _bytes(b))


def test_stochastic_rounding_is_unbiased():
  """b2 * nu must decay in bfloat16: the mean of many roundings of x is x, not its nearest bfloat16."""
  x = np.full(200_000, 1.0 + 2**-10, np.float32)  # a quarter of a bfloat16 ulp above 1
  back = np.asarray(mf.decode(mf.encode(jnp.asarray(x), "bfloat16", jnp.float32(7), 1), x.shape, "bfloat16", 1))
  assert abs(back.mean() - x[0]) < 2**-12


def _bytes(x) -> np.ndarray:
  return np.asarray(x).reshape(-1).view(np.uint8)


def _run(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
def test_every_placement_follows_float32_adam_within_the_format(moments):
  rng = np.random.default_rng()
  params = random_tree(rng, SHAPES_BLOCKS)
  grads = [random_tree(rng, SHAPES_BLOCKS) for _ in range(STEPS)]
  ref, _ = _run(optax.adamw(LR, weight_decay=0.1), params, grads)
  states = {}
  for plan in ("device", "host", ["host", "stream", "device", "host", "stream"]):
    tx = jax_dos.interleaved_adam(LR, weight_decay=0.1, subgroup_size=100, plan=plan, moments=moments)
    p, state = _run(tx, params, grads)
    states[str(plan)] = state
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)):
      assert np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0) <= TOL[moments] * LR * STEPS, plan
    for leaf, x in zip(jax.tree.leaves(state.mu), jax.tree.leaves(params)):
      assert leaf.dtype == mf.stored_dtype(moments) and leaf.shape == mf.stored_shape(x.shape, moments)
  # One rounding on every path: the host kernel's float32 arithmetic is that of XLA to an ulp (XLA may fuse a
  # multiply-add), which flips a rounding decision only where a moment lies within an ulp of a rounding threshold.
  assert _differing_fraction(states["device"], states["host"]) <= 0.02


def _differing_fraction(states_a, states_b) -> float:
  mine, other = (jax.tree.leaves(s.mu) + jax.tree.leaves(s.nu) for s in (states_a, states_b))
  differing = sum(int(np.sum(_bytes(a) != _bytes(b))) for a, b in zip(mine, other))
  return differing / sum(np.asarray(a).nbytes for a in mine)


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
def test_traced_update_params_rounds_as_the_eager_one(moments):
  rng = np.random.default_rng()
  params = random_tree(rng, SHAPES_BLOCKS)
  grads = [random_tree(rng, SHAPES_BLOCKS) for _ in range(3)]
  tx = jax_dos.interleaved_adam(LR, plan="device", moments=moments)
  eager_p, eager_s = _run(tx, params, grads)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: jax_dos.update_params(tx, g, s, p))
  p = params
  for g in grads:
    p, state = step(g, state, p)
  # XLA fuses one program otherwise than the other (a multiply-add, an ulp); the roundings are the same.
  assert _differing_fraction(eager_s, state) <= 0.02
  for a, b in zip(jax.tree.leaves(eager_p), jax.tree.leaves(p)):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0) <= TOL[moments] * LR


def test_bad_moments_are_refused():
  with pytest.raises(ValueError, match=r"'float32', 'bfloat16', 'int8'"):
    jax_dos.interleaved_adam(1e-3, moments="fp8")
  with pytest.raises(ValueError, match="delay_predict"):
    jax_dos.interleaved_adam(1e-3, moments="int8", delay=1, delay_predict="moments", plan="host")
  params = random_tree(np.random.default_rng())
  state = jax_dos.interleaved_adam(1e-3, plan="device").init(params)
  with pytest.raises(ValueError, match="CheckpointManager"):
    jax_dos.interleaved_adam(1e-3, plan="device", moments="int8").update(params, state, params)


def test_optax_state_holds_the_decoded_moments():
  rng = np.random.default_rng()
  params = random_tree(rng, SHAPES_BLOCKS)
  tx = jax_dos.interleaved_adam(LR, plan="host", moments="int8")
  _, state = _run(tx, params, [random_tree(rng, SHAPES_BLOCKS) for _ in range(2)])
  adam = jax_dos.to_optax_adamw_state(state, schedule=False)[0]
  for salt, (ours, theirs) in enumerate(((state.mu, adam.mu), (state.nu, adam.nu))):
    for x, y, p in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), jax.tree.leaves(params)):
      assert y.dtype == jnp.float32 and y.shape == p.shape
      np.testing.assert_array_equal(np.asarray(y), np.asarray(mf.decode(jnp.asarray(x), p.shape, "int8", salt)))


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
def test_overlapped_step_follows_float32_adam_within_the_format(moments):
  from overlap_model import B1, B2, FIRES, MIXED, STAGES, WD, _subgroup_count, make_batch, make_groups, reference_run
  from overlap_model import LR as OVERLAP_LR

  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  tx = jax_dos.interleaved_adamw(OVERLAP_LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, moments=moments,
                                 plan=MIXED[: _subgroup_count(groups)])  # fmt: skip
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), clip_norm=FIRES, micro_batches=2)
  for batch in batches:
    step(batch)
  state = step.opt_state
  masters, _ = reference_run(groups, batches, FIRES, 2)
  assert {x.dtype for x in jax.tree.leaves(state.mu)} == {mf.stored_dtype(moments)}
  for ours, theirs in zip(jax.tree.leaves(state.master), jax.tree.leaves(masters)):
    assert np.max(np.abs(np.asarray(ours) - np.asarray(theirs))) <= TOL[moments] * OVERLAP_LR * len(batches)
  step.close()


def test_planner_counts_each_formats_bytes(monkeypatch):
  from jax_dos.planning.cost_model import Calibration, kernel_bytes
  from jax_dos.planning.plan import STATE_BYTES
  from jax_dos.planning.planner import make_plan

  monkeypatch.setattr(jax_dos.memory.kinds, "device_free_bytes", lambda: None)
  g = 1e9
  cal = Calibration(host_rate=1 * g, stream_rate=1 * g, device_rate=100 * g, host_rate_concurrent=1 * g,
                    stream_rate_concurrent=1 * g)  # fmt: skip
  assert kernel_bytes("float32") == 28 and kernel_bytes("bfloat16") == 20
  assert cal.for_moments("bfloat16").host_rate == pytest.approx(1.4 * g)
  assert cal.for_moments("int8").host_rate == pytest.approx(28 / (12 + 4 * (1 + 4 / mf.BLOCK)) * g)
  # Where the calibration timed the kernel with each format, the host path takes the measured ratio (the compact
  # kernels are bound by their arithmetic, not the bytes): bfloat16 1.1x, int8 0.7x; the stream path and the
  # resident update keep the bytes' ratios.
  timed = dataclasses.replace(cal, host_kernel_rate=3 * g, host_kernel_rate_bfloat16=3.3 * g,
                              host_kernel_rate_int8=2.1 * g)  # fmt: skip
  for moments, ratio in (("bfloat16", 1.1), ("int8", 0.7)):
    scaled = timed.for_moments(moments)
    assert timed.kernel_ratio(moments) == pytest.approx(ratio)
    assert scaled.host_rate == pytest.approx(ratio * g) and scaled.host_rate_concurrent == pytest.approx(ratio * g)
    assert scaled.host_kernel_rate == pytest.approx(3 * ratio * g)
    assert scaled.stream_rate == cal.for_moments(moments).stream_rate
    assert scaled.device_rate == cal.for_moments(moments).device_rate
  params = [jnp.zeros((1024,)) for _ in range(8)]
  budget = STATE_BYTES * 2048  # two subgroups of float32 state
  resident = {}
  for moments in mf.FORMATS:
    plan = make_plan(params, 1024, cal, resident_budget_bytes=budget, staging_budget_bytes=None, moments=moments)
    resident[moments] = plan.elements("device")
    assert resident[moments] * mf.state_bytes_per_param(moments) <= budget
  assert resident["float32"] == 2048 and resident["bfloat16"] == 3072 and resident["int8"] == 3072


@pytest.mark.parametrize(
  "flags,match",
  [(["--moments", "int8", "--offload", "none"], "--offload none"),
   (["--moments", "bfloat16", "--delay", "1", "--delay-predict"], "--delay-predict"),
   (["--moments", "fp8"], "invalid choice")],
)  # fmt: skip
def test_train_gpt_refuses_what_compact_moments_cannot_do(flags, match, capsys):
  from train import flags as F

  with pytest.raises(SystemExit):
    F.parse_args(["--d-model", "32", *flags])
  assert match in capsys.readouterr().err


def test_write_behind_and_the_plain_delay_keep_the_rounding():
  """write_behind's two kernel passes give the one pass's bits; delay=1 takes the same host steps, one step late."""
  rng = np.random.default_rng()
  params = random_tree(rng, SHAPES_BLOCKS)
  grads = [random_tree(rng, SHAPES_BLOCKS) for _ in range(3)]
  runs = []
  for kw in ({}, {"write_behind": True}, {"delay": 1, "delay_warmup": 1}):
    runs.append(_run(jax_dos.interleaved_adam(LR, plan="host", moments="int8", **kw), params, grads)[1])
    jax_dos.wait_for_host_updates()  # this run's host updates done before the next run starts
  for other in runs[1:]:
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(other)):
      np.testing.assert_array_equal(_bytes(a), _bytes(b))


def test_the_overlapped_plan_counts_each_formats_host_bytes():
  """One host budget holds more of the host path with compact state: the timeline planner counts its bytes."""
  from overlap_model import B1, B2, STAGES, WD, make_groups
  from overlap_model import LR as OVERLAP_LR

  from jax_dos.overlap import memory as overlap_memory
  from jax_dos.overlap import plan as overlap_plan

  groups = make_groups(np.random.default_rng())
  sizes = jax_dos.planning.plan.partition_groups(groups, 40)[1]
  budget, times = 16 * sum(sizes), jax_dos.StageTimes((1.0,) * len(STAGES), (2.0,) * len(STAGES))
  layout = overlap_plan.step_layout(jax_dos.StagedModel(STAGES, len(groups)), groups, 40)
  host = {}
  for moments in ("float32", "int8"):
    planner = jax_dos.auto_planner(jax_dos.Calibration(100.0, 10.0, 1e6, 100.0, 10.0))  # the host path is faster
    tx = jax_dos.interleaved_adamw(OVERLAP_LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, moments=moments,
                                   planner=planner)  # fmt: skip
    plan = jax_dos.overlapped_plan(tx, STAGES, groups, stage_times=times, host_budget_bytes=budget)
    cap = overlap_memory.speculation_cap(plan, layout, budget, moments)
    assert overlap_memory.host_bytes(plan, layout, cap, moments) <= budget
    host[moments] = plan.elements("host")
    n = sum(sizes)
    assert jax_dos.host_need_bound(n, moments=moments) == math.ceil((mf.state_bytes_per_param(moments) + 4) * n)
  assert 0 < host["float32"] < host["int8"]
