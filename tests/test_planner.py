"""The performance model and the planner, on synthetic calibrations (no timing)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_dos
from jax_dos.planning.budgets import STEP_MARGIN, UPDATE_BYTES, BudgetInputs, StepMemory, resolve_budgets
from jax_dos.planning.cost_model import Calibration, predict
from jax_dos.planning.plan import STAGING_BYTES, STATE_BYTES
from jax_dos.planning.planner import auto_planner, make_plan
from jax_dos.planning.search import plan_sizes

G = 1e9


def cal(h, s, d=100.0, h_c=None, s_c=None, **kw) -> Calibration:
  """Rates in G params/s; concurrent rates default to the solo ones (paths add up)."""
  return Calibration(
    host_rate=h * G,
    stream_rate=s * G,
    device_rate=d * G,
    host_rate_concurrent=(h if h_c is None else h_c) * G,
    stream_rate_concurrent=(s if s_c is None else s_c) * G,
    **kw,
  )


def random_cal(rng) -> Calibration:
  h, s = rng.uniform(0.5, 8.0, size=2)
  share = rng.uniform(0.3, 1.0, size=2)  # concurrency: each path keeps a share of its solo rate
  return cal(
    h,
    s,
    d=rng.uniform(20, 200),
    h_c=h * share[0],
    s_c=s * share[1],
    stream_rate_single=s * G * rng.uniform(0.3, 1),
    subgroup_overhead_host=rng.uniform(0, 1e-3),
    subgroup_overhead_stream=rng.uniform(0, 1e-3),
    device_call_overhead=rng.uniform(0, 1e-3),
    step_overhead=rng.uniform(0, 1e-3),
  )


def budgets_for(**inputs):
  """:func:`resolve_budgets` of ``BudgetInputs(**inputs)``, without a calibration."""
  return resolve_budgets(BudgetInputs(**inputs))


def counts(choice):
  return {p: choice.placements.count(p) for p in ("device", "stream", "host")}


def single_path_totals(sizes, c, resident, staging, max_slots=2):
  """Predicted totals of the single-path plans a person would try, computed with `predict` directly."""
  fit, used = set(), 0
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    if used + STATE_BYTES * sizes[i] <= resident:
      fit.add(i)
      used += STATE_BYTES * sizes[i]
  out = []
  for dev in (set(), fit):
    rest = [sizes[i] for i in range(len(sizes)) if i not in dev]
    n_d = sum(sizes[i] for i in dev)
    out.append(predict(c, n_device=n_d, n_host=sum(rest), k_host=len(rest))["total"])
    largest = STAGING_BYTES * max(rest, default=0)
    if rest and (staging is None or largest <= staging):
      slots = max_slots if staging is None or largest == 0 else min(max_slots, staging // largest)
      out.append(predict(c, n_device=n_d, n_stream=sum(rest), k_stream=len(rest), stream_slots=slots)["total"])
  return out


@pytest.mark.parametrize("h,s,n", [(4.0, 2.0, 30), (3.0, 1.0, 40), (1.0, 1.0, 24), (2.5, 5.0, 45)])
def test_additive_paths_split_in_proportion_to_rates(h, s, n):
  # Paths that add up: both finish together when N_S / N = s / (h + s), in time N / (h + s).
  sizes = [1000] * n
  choice = plan_sizes(sizes, cal(h, s))
  assert counts(choice)["stream"] == round(n * s / (h + s))
  assert counts(choice)["device"] == 0
  assert choice.predicted["total"] == pytest.approx(sum(sizes) / ((h + s) * G), rel=1e-9)


@pytest.mark.parametrize("h,s", [(4.0, 3.0), (3.0, 4.0), (4.2, 3.6)])
def test_full_contention_picks_a_single_path(h, s):
  # Concurrent total equals the larger solo rate: splitting cannot win, so one path takes all.
  top = max(h, s)
  c = cal(h, s, h_c=top * h / (h + s), s_c=top * s / (h + s))
  choice = plan_sizes([1000] * 20, c)
  assert set(choice.placements) == {"host" if h >= s else "stream"}
  assert choice.predicted["total"] == pytest.approx(20000 / (top * G), rel=1e-9)


@pytest.mark.parametrize("fast", ["host", "stream"])
def test_one_path_far_faster_takes_everything(fast):
  # Running both slows each by 10% (shared DRAM): the slow path's share cannot pay for that.
  c = cal(100.0, 1.0, h_c=90.0, s_c=0.9) if fast == "host" else cal(1.0, 100.0, h_c=0.9, s_c=90.0)
  choice = plan_sizes([5000] * 7 + [300] * 5, c)
  assert set(choice.placements) == {fast}


def test_resident_budget_filled_and_respected():
  rng = np.random.default_rng(0)
  for _ in range(20):
    sizes = [int(x) for x in rng.integers(1, 10_000, size=int(rng.integers(1, 40)))]
    budget = int(rng.integers(0, STATE_BYTES * sum(sizes)))
    choice = plan_sizes(sizes, cal(4.2, 3.2, h_c=2.3, s_c=1.9), resident_budget_bytes=budget)
    resident = sum(n for n, p in zip(sizes, choice.placements, strict=True) if p == "device")
    assert STATE_BYTES * resident <= budget
    # Device is ~30x faster: whatever is left is too big for the rest of the budget.
    left = [n for n, p in zip(sizes, choice.placements, strict=True) if p != "device"]
    assert all(STATE_BYTES * (resident + n) > budget for n in left)


def test_staging_budget_bounds_stream_slots():
  rng = np.random.default_rng(1)
  for _ in range(30):
    sizes = [int(x) for x in rng.integers(1, 10_000, size=int(rng.integers(1, 30)))]
    staging = int(rng.integers(0, STAGING_BYTES * 3 * max(sizes)))
    max_slots = int(rng.integers(1, 5))
    choice = plan_sizes(sizes, cal(2.0, 4.0), staging_budget_bytes=staging, max_stream_slots=max_slots)
    streamed = [n for n, p in zip(sizes, choice.placements, strict=True) if p == "stream"]
    assert 1 <= choice.stream_slots <= max_slots
    if streamed:
      assert choice.stream_slots * STAGING_BYTES * max(streamed) <= staging


def test_too_small_budgets_fall_back_to_host():
  sizes = [4096, 1000, 8192]
  choice = plan_sizes(sizes, cal(1.0, 50.0), resident_budget_bytes=0, staging_budget_bytes=STAGING_BYTES * 999)
  assert choice.placements == ("host",) * 3
  choice = plan_sizes(sizes, cal(1.0, 50.0), resident_budget_bytes=5, staging_budget_bytes=0)
  assert choice.placements == ("host",) * 3
  # Only the smallest subgroup can be staged, one at a time.
  choice = plan_sizes(sizes, cal(1.0, 50.0), staging_budget_bytes=STAGING_BYTES * 1000)
  assert choice.placements == ("host", "stream", "host") and choice.stream_slots == 1
  assert plan_sizes([], cal(1.0, 1.0)).placements == ()


def test_never_predicted_slower_than_a_single_path():
  rng = np.random.default_rng(2)
  for _ in range(40):
    c = random_cal(rng)
    sizes = [int(x) for x in rng.integers(0, 2**22, size=int(rng.integers(1, 25)))]
    resident = int(rng.choice([0, rng.integers(0, STATE_BYTES * sum(sizes) + 1)]))
    staging = None if rng.random() < 0.3 else int(rng.integers(0, STAGING_BYTES * 3 * max(sizes) + 1))
    choice = plan_sizes(sizes, c, resident_budget_bytes=resident, staging_budget_bytes=staging)
    for t in single_path_totals(sizes, c, resident, staging):
      assert choice.predicted["total"] <= t * (1 + 1e-12)


def test_concurrency_model_by_hand():
  # Host 3 s solo work at half speed while streaming; stream 1 s at half speed, starting after 0.5 s of device work.
  c = cal(1.0, 1.0, d=1.0, h_c=0.5, s_c=0.5)
  p = predict(c, n_device=0.5 * G, n_host=3 * G, n_stream=1 * G)
  # 0-0.5: host alone (2.5 left); 0.5-2.5: both at half speed (host 1.5 left, stream done); 2.5-4: host alone.
  assert p["device"] == pytest.approx(0.5)
  assert p["stream"] == pytest.approx(2.5)
  assert p["host"] == pytest.approx(4.0)
  assert p["total"] == pytest.approx(4.0)


def test_deterministic():
  rng = np.random.default_rng(3)
  c = random_cal(rng)
  sizes = [int(x) for x in rng.integers(1, 2**20, size=50)]
  kw = dict(resident_budget_bytes=STATE_BYTES * sum(sizes) // 4, staging_budget_bytes=STAGING_BYTES * 2**21)
  assert plan_sizes(sizes, c, **kw) == plan_sizes(list(sizes), c, **kw)


def _params(rng, shapes):
  return {f"l{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}


@pytest.fixture
def no_memory_stats(monkeypatch):
  """The accelerator reports no free memory, as on the CPU backend: budgets come from the calibration or are 0."""
  monkeypatch.setattr(jax_dos.memory.kinds, "device_free_bytes", lambda: None)


def test_make_plan_on_a_tree(no_memory_stats):
  rng = np.random.default_rng(4)
  params = _params(rng, [(64, 32), (32,), (128, 16), (7,), (256,)])
  c = cal(4.2, 3.2, h_c=2.3, s_c=1.9)
  plan = make_plan(params, 2048, c, resident_budget_bytes=STATE_BYTES * 2048, staging_budget_bytes=None)
  assert plan.source == "model" and plan.calibration == c.to_dict()
  assert STATE_BYTES * plan.elements("device") <= STATE_BYTES * 2048
  assert plan.elements("device") > 0 and "total" in plan.predicted
  assert plan == make_plan(params, 2048, c.to_dict(), resident_budget_bytes=STATE_BYTES * 2048)
  # No memory statistics, no budgets given: nothing resident, so CI exercises offload.
  plan = make_plan(params, 1000, c)
  assert plan.elements("device") == 0 and len(plan.indices("host") + plan.indices("stream")) == len(plan.sizes)


def test_auto_planner_drives_interleaved_adam_like_optax(no_memory_stats):
  rng = np.random.default_rng(5)
  params = _params(rng, [(32, 16), (16,), (64,), (8, 8)])
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  c = cal(1.0, 1.0, h_c=0.6, s_c=0.6)  # split pays: both paths get used
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=600, planner=auto_planner(c))
  plan = jax_dos.get_plan(tx, params)
  assert plan.source == "model" and {"host", "stream"} <= set(plan.placements)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  updates, _ = tx.update(grads, tx.init(params), params)
  expected, _ = ref.update(grads, ref.init(params), params)
  # The contract is on the parameters: optax.apply_updates lands on optax's to float32 rounding.
  new, want = optax.apply_updates(params, updates), optax.apply_updates(params, expected)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kept", ["flushed", "kept"], ids=["grads_flushed", "grads_kept"])
@pytest.mark.parametrize("in_place", [False, True], ids=["update_tree", "params_in_place"])
@pytest.mark.parametrize("seed", range(4))
def test_step_memory_budgets_by_hand(seed, in_place, kept):
  """The budgets fit both phases and are the largest that do; gradients the step kept are not counted twice."""
  rng = np.random.default_rng(seed)
  gib = 2**30
  free, n, largest = int(rng.integers(40, 80)) * gib, int(rng.integers(1, 4)) * 10**9, 64 * 2**20
  # Flushed: the step leaves a few GiB alive; kept: every bfloat16 gradient stays on the accelerator (flush none).
  live = int(rng.integers(0, 3)) * gib if kept == "flushed" else 2 * n
  step = StepMemory(peak_bytes=int(rng.integers(10, 20)) * gib + live, live_bytes=live)
  usable = int((1 - STEP_MARGIN) * free)
  update_bytes = 0 if in_place else UPDATE_BYTES  # jax_dos.update_params makes no fp32 update tree
  relayout = int(rng.integers(0, 3)) * gib  # a partitioned state's new weights (or updates) gathered in the update

  def update_phase(resident, staging):  # resident state, its gradients unless kept, staging, what the step left
    back = max(0, 2 * resident // STATE_BYTES - live)
    return resident + back + staging + live + update_bytes * n + relayout

  got = budgets_for(
    free_bytes=free, step_memory=step, device_elements=n, largest_subgroup=largest, grad_itemsize=2,
    params_in_place=in_place, relayout_bytes=relayout,
  )  # fmt: skip
  resident, staging = got.resident, got.staging
  assert got.ahead is None
  assert resident + step.peak_bytes <= usable and update_phase(resident, staging) <= usable + 2
  if resident < STATE_BYTES * n:  # a GiB more breaks a phase, with two streaming slots kept
    more = resident + gib
    assert more + step.peak_bytes > usable or update_phase(more, 2 * STAGING_BYTES * largest) > usable
    assert update_phase(resident, 0) + 2 * STAGING_BYTES * largest <= usable + 2 or resident == 0
  if kept == "kept" and resident < STATE_BYTES * n:  # resident gradients are in live already, not counted again
    slots = 2 * STAGING_BYTES * largest
    assert resident == max(0, min(usable - step.peak_bytes, usable - live - update_bytes * n - relayout - slots))


def test_step_memory_budgets_edges():
  gib = 2**30
  # The whole state fits beside the step: no staging slots held back, everything can be resident.
  n = 10**9
  got = budgets_for(free_bytes=100 * gib, step_memory=StepMemory(20 * gib), device_elements=n, largest_subgroup=n)
  assert got[0] >= STATE_BYTES * n
  # A step that needs more than is free leaves nothing resident and no staging (never negative).
  short = budgets_for(free_bytes=10 * gib, step_memory=StepMemory(20 * gib, 15 * gib), device_elements=n)
  assert short[:2] == (0, 0)
  # Explicit budgets win over the step's.
  kw = dict(free_bytes=100 * gib, step_memory=StepMemory(20 * gib), device_elements=n)
  assert budgets_for(resident_budget_bytes=gib, staging_budget_bytes=2 * gib, **kw)[:2] == (gib, 2 * gib)
  with pytest.raises(ValueError, match="live_bytes <= peak_bytes"):
    StepMemory(peak_bytes=1, live_bytes=2)


def test_step_memory_of_a_compiled_program_and_the_plan_it_gives(no_memory_stats):
  rng = np.random.default_rng(7)
  params = _params(rng, [(256, 64), (64,), (512, 32), (128,)])
  n = sum(x.size for x in jax.tree.leaves(params))

  def grad_fn(p, x):
    return jax.grad(lambda p: sum(jnp.sum(jnp.tanh(v * x[: v.shape[-1]])) for v in jax.tree.leaves(p)))(p)

  step = StepMemory.of(jax.jit(grad_fn).lower(params, jnp.ones((256,))).compile())
  assert step.live_bytes >= 4 * n and step.peak_bytes >= step.live_bytes  # the gradients are outputs
  room = (STATE_BYTES + 4) * n + max(step.peak_bytes, step.live_bytes + UPDATE_BYTES * n) + 4096
  c = cal(1.0, 1.0, device_free_bytes=int(room / (1 - STEP_MARGIN)))
  roomy = make_plan(params, 4096, c, step_memory=step)  # room for all the state in both phases: all resident
  assert roomy.elements("device") == n
  tight = make_plan(params, 4096, c, step_memory=StepMemory(step.peak_bytes * 100, step.live_bytes))
  assert tight.elements("device") == 0


def test_bad_input_is_explained():
  with pytest.raises(ValueError, match="positive finite"):
    cal(0.0, 1.0)
  with pytest.raises(ValueError, match="one entry per subgroup"):
    plan_sizes([1, 2], cal(1.0, 1.0), leaf_counts=[1])
  with pytest.raises(ValueError, match="max_stream_slots"):
    plan_sizes([1], cal(1.0, 1.0), max_stream_slots=0)


@pytest.mark.parametrize("seed", range(4))
def test_state_copies_sent_ahead_take_what_the_resident_state_leaves(seed):
  """delay_predict='gradient': the copies never shrink the resident budget; they get what both phases leave free."""
  rng = np.random.default_rng(seed)
  gib = 2**30
  free, n = int(rng.integers(70, 80)) * gib, int(rng.integers(1, 9)) * 10**9
  step = StepMemory(peak_bytes=int(rng.integers(5, 10)) * gib, live_bytes=int(rng.integers(0, 3)) * gib)
  usable = int((1 - STEP_MARGIN) * free)
  fb_room, update_room = usable - step.peak_bytes, usable - step.live_bytes
  back = lambda r: r + max(0, 2 * r // STATE_BYTES - step.live_bytes)  # noqa: E731  (resident gradients come back)
  kw = dict(free_bytes=free, step_memory=step, device_elements=n, largest_subgroup=2**26, grad_itemsize=2,
            params_in_place=True)  # fmt: skip
  plain = budgets_for(**kw)
  got = budgets_for(**kw, ahead_bytes=6)  # bfloat16 parameters: copies of master, mu, nu in bfloat16
  assert got[:2] == plain[:2] and plain.ahead is None
  state = min(got.resident, STATE_BYTES * n)  # the budget may exceed the whole state
  assert abs(got.ahead - max(0, min(fb_room - state, update_room - back(state)))) <= 1
  assert state + got.ahead <= fb_room and back(state) + got.ahead <= update_room + 1


def test_a_step_with_no_room_left_sends_no_copies_ahead():
  gib = 2**30
  # 6e9 parameters, 40 GiB free, 20 GiB for the step: resident state takes what is left, copies cross in update.
  got = budgets_for(free_bytes=40 * gib, step_memory=StepMemory(20 * gib), device_elements=6 * 10**9, ahead_bytes=6)
  assert got.resident > 0 and got.ahead < 2**20  # (rounding)
  # The whole state resident with room to spare: the rest may hold copies (none are needed).
  got = budgets_for(free_bytes=100 * gib, step_memory=StepMemory(gib), device_elements=10**9, ahead_bytes=6)
  assert got.resident >= STATE_BYTES * 10**9 and got.ahead > 0
  # Without memory statistics (the CPU backend) every copy is sent ahead.
  assert budgets_for(device_elements=10**9, ahead_bytes=6, free_bytes=None).ahead is None


def test_state_copies_share_the_guessed_resident_fraction():
  """Without the step's needs the resident guess leaves room for the copies sent ahead (never below 0)."""
  gib, n = 2**30, 10**9
  plain = budgets_for(free_bytes=60 * gib, device_elements=n).resident
  ahead = budgets_for(free_bytes=60 * gib, device_elements=n, ahead_bytes=6).resident
  assert plain == int(0.4 * 60 * gib)
  assert ahead + 6 * (n - ahead / STATE_BYTES) <= plain + 1 and ahead < plain
  assert budgets_for(free_bytes=4 * gib, device_elements=n, ahead_bytes=6)[0] == 0
