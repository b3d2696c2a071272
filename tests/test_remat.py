"""Rematerialisation policies per stage (``jax_dos.staged.remat``, ``Stage.remat``) and the plan that chooses them.

A policy changes what a stage's forward program keeps and its backward
program recomputes, never the numbers: the staged model's losses and
gradients, and the overlapped step's parameters, equal full
rematerialisation's to float32 rounding. The plan chooses the policies beside
the optimizer state's placements, from the stages' costs and the room beside
the step's peak: full rematerialisation where nothing else fits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_rel_diff
from jax.ad_checkpoint import checkpoint_name

import jax_dos
from jax_dos.planning.plan import STAGING_BYTES, STATE_BYTES
from models import gpt as G

D_IN, D_H, ROWS = 6, 8, 8


def _embed(params, x, batch):
  (g,) = params
  return jnp.tanh(batch[0] @ g["w"] + g["b"])


def _block(params, x, batch):
  (g,) = params
  h = checkpoint_name(x @ g["w"] + g["b"], "mlp_in")
  return x + checkpoint_name(jnp.tanh(h) @ g["w2"], "mlp_out")


def _head(params, x, batch):
  head, embed = params
  return jnp.mean(((x * head["scale"]) @ embed["w"].T - batch[1]) ** 2)


def toy_stages(policies=("full",) * 4) -> list[jax_dos.Stage]:
  fns = [(_embed, (0,)), (_block, (1,)), (_block, (2,)), (_head, (3, 0))]
  return [jax_dos.Stage(fn, groups, p) for (fn, groups), p in zip(fns, policies)]


def toy_groups(rng: np.random.Generator) -> list:
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
  blocks = [{"b": normal(D_H), "w": normal(D_H, D_H), "w2": normal(D_H, D_H)} for _ in range(2)]
  return [{"b": normal(D_H), "w": normal(D_IN, D_H)}, *blocks, {"scale": 1 + normal(D_H)}]


def toy_batch(rng: np.random.Generator) -> tuple:
  return tuple(jnp.asarray(rng.standard_normal((ROWS, D_IN)), jnp.float32) for _ in range(2))


def test_gpt_stages_under_every_policy_give_full_remats_loss_and_gradients():
  """The staged GPT (tiny widths) with a policy per stage against today's full remat; and what each policy keeps."""
  rng = np.random.default_rng()
  cfg = G.get_config("tiny", n_layer=3, n_head=2, d_model=32, block_size=16, vocab_size=64)
  _, params = G.init_params(cfg, seed=int(rng.integers(1 << 30)))
  staged = G.staged(cfg)
  groups = staged.split(params)
  tokens = lambda: jnp.asarray(rng.integers(0, cfg.vocab_size, (4, cfg.block_size)), jnp.int32)  # noqa: E731
  batch = (tokens(), tokens())
  stages = staged.stages
  full = jax_dos.StagedModel(stages, len(groups)).loss_and_grads(groups, batch, micro_batches=2)
  policies = ["full", "minimal", "none", "offload", "full"]  # embeddings, three blocks, head
  model = jax_dos.StagedModel([dataclasses.replace(st, remat=p) for st, p in zip(stages, policies)], len(groups))
  loss, grads = model.loss_and_grads(groups, batch, micro_batches=2)
  np.testing.assert_allclose(float(loss), float(full[0]), rtol=1e-6)
  assert max_rel_diff(grads, full[1]) < 1e-5
  part, xs, kept = jax_dos.staged.micro_batches.micro_batch(batch, 0, 2), [None], []
  for i in range(4):
    x, saved = model.forward(i, (groups[i],), xs[-1], part)  # embeddings: full, nothing kept
    xs.append(x)
    kept.append(saved)
  # The tagged outputs the backward pass needs, of one micro-batch in float32: qkv_proj, out_proj (the second norm's
  # input is recomputed from it) and mlp_in; mlp_out feeds only the residual sum, so nothing keeps it.
  tagged = 2 * cfg.block_size * (3 + 1 + 4) * cfg.d_model * 4
  assert kept[1].device_bytes() == tagged  # minimal
  assert kept[2].device_bytes() > tagged  # none: the norms' and the attention's intermediates too
  assert kept[3].device_bytes() == 0 and sum(a.nbytes for a in kept[3].arrays) == tagged  # offload: in host memory
  assert kept[0] is None


def test_overlapped_step_under_per_stage_policies_equals_full_remat():
  """Two steps of two micro-batches (stage-major) with a policy per stage, given by the stages or by the plan, against
  all "full": the same losses and parameters."""
  rng = np.random.default_rng()
  groups, batches = toy_groups(rng), [toy_batch(rng) for _ in range(2)]
  tx = jax_dos.interleaved_adamw(1e-2, weight_decay=0.1, subgroup_size=40, plan="device")
  planned = jax_dos.overlapped_plan(tx, toy_stages(), groups)
  planned = dataclasses.replace(planned, remat=("full", "none", "none", "full"))
  out = []
  for policies, plan in ((("full",) * 4, None), (("none", "minimal", "none", "full"), None), (("full",) * 4, planned)):
    step = jax_dos.OverlappedStep(tx, toy_stages(policies), jax.tree.map(jnp.copy, groups), clip_norm=1.0,
                                  micro_batches=2, plan=plan)  # fmt: skip
    assert [st.remat for st in step.model.stages] == list(policies if plan is None else plan.remat)
    losses = [float(step(batch)) for batch in batches]
    out.append((losses, step.params))
    step.close()
  for losses, params in out[1:]:
    np.testing.assert_allclose(losses, out[0][0], rtol=1e-6)
    assert max_rel_diff(params, out[0][1]) < 1e-5


def hand_made_times(k_saved: int) -> jax_dos.StageTimes:
  """Stage costs where lighter policies save backward time and keep ``k_saved`` bytes (minimal) or twice (none)."""

  def costs(backward: float, saved: int) -> jax_dos.RematCosts:
    return jax_dos.RematCosts((1.0, 1.0, 1.0, 0.0), (2.0, backward, backward, 2.0), (0, saved, saved, 0), (0,) * 4)

  remat = {"full": costs(2.0, 0), "minimal": costs(1.5, k_saved), "none": costs(1.2, 2 * k_saved)}
  return jax_dos.StageTimes((1.0, 1.0, 1.0, 0.0), (2.0,) * 4, 0, remat, ("full", "minimal", "none"))


def plan_under_memory(monkeypatch, groups, times, room: int, rate: float = 2e9, fired_share: float = 0.0):
  """The overlapped step's plan for a device whose room beside the step's peak is ``room`` bytes (the host path's
  rate ``rate`` parameters a second, the others in proportion)."""
  monkeypatch.setattr(jax_dos.memory.kinds, "device_free_bytes", lambda: None)  # the calibration's figure
  free = 10 * room
  cal = jax_dos.Calibration(rate, 1.5 * rate, 25 * rate, 0.9 * rate, rate, device_free_bytes=free)
  peak = int(free * (1 - 0.08)) - room
  planner = jax_dos.auto_planner(cal, step_memory=jax_dos.StepMemory(peak, 0), params_in_place=True)
  tx = jax_dos.interleaved_adamw(1e-2, subgroup_size=40, planner=planner)
  return jax_dos.overlapped_plan(tx, toy_stages(), groups, stage_times=times, micro_batches=2,
                                 fired_share=fired_share)  # fmt: skip


def test_the_plan_keeps_full_remat_where_nothing_else_fits_and_saves_activations_where_memory_allows(monkeypatch):
  rng = np.random.default_rng()
  groups = toy_groups(rng)
  slot = STAGING_BYTES * max(jax_dos.planning.plan.partition_groups(groups, 40)[1])
  saved = int(rng.integers(1, 4)) * 10**6  # one block's "minimal" residuals, one micro-batch
  times = hand_made_times(saved)
  # Room for a streaming slot, but not for one block's minimal residuals of both micro-batches beside it.
  short = plan_under_memory(monkeypatch, groups, times, slot + 2 * saved - 1)
  assert short.remat == ("full",) * 4
  assert short.predicted["step"] == pytest.approx(2 * 11.0, rel=1e-3)  # 2 micro-batches of 3 s forward, 8 backward
  # Room for every block's "none" residuals of both micro-batches beside a slot: no recomputation left.
  ample = plan_under_memory(monkeypatch, groups, times, slot + 2 * 2 * 2 * saved)
  assert ample.remat == ("full", "none", "none", "full")
  assert ample.predicted["step"] == pytest.approx(short.predicted["step"] - 2 * 2 * 0.8, rel=1e-3)
  # Between the two: the policies that fit, never more than the room.
  middle = plan_under_memory(monkeypatch, groups, times, slot + 2 * 2 * saved)
  assert middle.remat not in (short.remat, ample.remat)
  kept = times.extra_activation_bytes(middle.remat, 2, "stage")
  assert kept <= middle.step_room_bytes - slot
  assert STATE_BYTES * middle.elements("device") + kept <= middle.step_room_bytes
  assert short.predicted["step"] > middle.predicted["step"] > ample.predicted["step"]


@pytest.mark.parametrize("minimal_backward, taken", [(1.78, "full"), (1.70, "minimal")])
def test_a_policy_is_taken_only_for_a_gain_beyond_the_models_error(monkeypatch, minimal_backward, taken):
  """With room for every block's activations, ``minimal`` on both blocks saves ``2 x 2 x (2.0 - b)`` s of the all-full
  step's 22 s: 0.88 s (4 %, within the model's 5 % error: ``full`` kept) or 1.2 s (5.5 %: taken)."""
  rng = np.random.default_rng()
  groups = toy_groups(rng)
  slot = STAGING_BYTES * max(jax_dos.planning.plan.partition_groups(groups, 40)[1])
  saved = 10**6

  def costs(backward: float, saved: int) -> jax_dos.RematCosts:
    return jax_dos.RematCosts((1.0, 1.0, 1.0, 0.0), (2.0, backward, backward, 2.0), (0, saved, saved, 0), (0,) * 4)

  remat = {"full": costs(2.0, 0), "minimal": costs(minimal_backward, saved)}
  times = jax_dos.StageTimes((1.0, 1.0, 1.0, 0.0), (2.0,) * 4, 0, remat, ("full", "minimal"))
  plan = plan_under_memory(monkeypatch, groups, times, slot + 4 * 2 * saved)
  assert jax_dos.PREDICTION_ERROR == 0.05
  want = ("full",) * 4 if taken == "full" else ("full", "minimal", "minimal", "full")
  assert plan.remat == want
  gain = 2 * 2 * (2.0 - minimal_backward) if taken == "minimal" else 0.0
  assert plan.predicted["step"] == pytest.approx(22.0 - gain, rel=1e-3)


def test_the_activation_memory_and_the_candidates_of_an_assignment():
  """Every micro-batch the order keeps counts its saved residuals; the largest temporaries count only where they
  grow; the candidates move the last block first, to the policy saving the most time per byte."""
  saved = int(np.random.default_rng().integers(1, 100)) * 1000
  times = hand_made_times(saved)
  temps = {"full": (1, 5, 5, 9), "minimal": (1, 7, 7, 9), "none": (1, 12, 12, 9)}
  remat = {p: dataclasses.replace(c, temp_bytes=temps[p]) for p, c in times.remat.items()}
  times = dataclasses.replace(times, remat=remat)
  mixed = ("full", "none", "minimal", "full")
  assert times.extra_activation_bytes(mixed, 3, "stage") == 3 * (2 * saved + saved) + 12 - 9
  assert times.extra_activation_bytes(mixed, 3, "batch") == 2 * saved + saved + 12 - 9
  assert times.extra_activation_bytes(("full", "minimal", "minimal", "full"), 3, "stage") == 3 * 2 * saved  # 7 < 9
  assert jax_dos.planning.timeline.remat_candidates(times) == [
    ("full",) * 4,
    ("full", "full", "minimal", "full"),  # 0.5 s per saved byte: minimal first, the last block first
    ("full", "minimal", "minimal", "full"),
    ("full", "minimal", "none", "full"),  # then 0.3 s for the next saved bytes
    ("full", "none", "none", "full"),
  ]
  assert times.assigned(mixed).backward == (2.0, 1.2, 1.5, 2.0)


def test_a_stage_closing_over_a_numpy_table_saves_it_like_any_residual():
  """A constant numpy table in a block (rotary frequencies, say) under ``none``: the gradients are ``full``'s."""
  rng = np.random.default_rng()
  table = rng.uniform(0.5, 1.5, D_H).astype(np.float32)

  def block(params, x, batch):
    (g,) = params
    return x + jnp.tanh(x @ g["w"]) * table

  groups, batch = toy_groups(rng), toy_batch(rng)
  fns = [(_embed, (0,)), (block, (1,)), (block, (2,)), (_head, (3, 0))]
  runs = [
    jax_dos.StagedModel([jax_dos.Stage(fn, g, p) for fn, g in fns], len(groups)).loss_and_grads(groups, batch)
    for p in ("full", "none")
  ]
  np.testing.assert_allclose(float(runs[1][0]), float(runs[0][0]), rtol=1e-6)
  assert max_rel_diff(runs[1][1], runs[0][1]) < 1e-5


def test_a_plan_for_a_firing_clip_gives_the_room_to_state_where_the_silent_plan_gives_it_to_activations(monkeypatch):
  """The toy's 336 parameters at 20 a second after the decision: a silent step hides their update under the backward
  pass (16 s), a fired one only under the next forward pass (6 s). Made for a silent clip, the plan keeps activations
  (lighter remat, 2.6 s less compute a step) and offloads most of the state, whose fired step then waits for it;
  made for a firing clip (``fired_share=1``) it keeps every stage ``full`` and the state resident: its fired step is
  the compute and the resident update (336 parameters at 500 a second), its bound, and a plan's predicted fired step
  is never below its bound."""
  groups = toy_groups(np.random.default_rng())
  times = hand_made_times(STATE_BYTES * 40)
  slot = STAGING_BYTES * max(jax_dos.planning.plan.partition_groups(groups, 40)[1])
  room = slot + 8 * STATE_BYTES * 40
  silent = plan_under_memory(monkeypatch, groups, times, room, rate=20.0)
  fired = plan_under_memory(monkeypatch, groups, times, room, rate=20.0, fired_share=1.0)
  assert silent.remat != ("full",) * 4 and fired.remat == ("full",) * 4
  assert fired.elements("device") > silent.elements("device")
  assert silent.predicted["step"] < fired.predicted["step"]
  assert fired.predicted["step_clip_fired"] < silent.predicted["step_clip_fired"]
  assert fired.predicted["step_clip_fired"] == pytest.approx(fired.predicted["compute_plain"] + 336 / 500)
  assert fired.predicted["step_clip_fired_bound"] == pytest.approx(fired.predicted["step_clip_fired"])
  for plan in (silent, fired):
    assert plan.predicted["step_clip_fired_bound"] <= plan.predicted["step_clip_fired"] + 1e-9
  with pytest.raises(ValueError, match="fired_share"):
    plan_under_memory(monkeypatch, groups, times, room, fired_share=1.5)
