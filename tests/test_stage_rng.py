"""Dropout in a user's own Flax NNX model trained through ``jax_dos.nnx_stages``: the plain NNX path's masks.

The reference is the plain path: ``nnx.value_and_grad`` of each micro-batch's loss over the model itself (each a
forward call drawing from the model's RNG streams), their mean, ``nnx.Optimizer`` with
``optax.chain(clip_by_global_norm, adamw)``, all under ``nnx.jit``. The model has dropout after the embedding and
before the head (one ``nnx.Dropout``, drawn from by the first and the last stage) and twice in each block (one
``nnx.Dropout`` called twice): each block forking its own stream (an ``nnx.List``, or a stack made with
``nnx.split_rngs`` and ``nnx.vmap`` and run with ``nnx.scan``), or every module drawing from one ``nnx.Rngs`` they
all keep (``shared``: the stream counts on across the layers in call order), or from the ``nnx.Rngs`` the model is
called with (``called``: ``model(tokens, rngs=rngs)``, the same ``rngs`` passed to every step; ``nnx.scan`` carries
it through a stack). The blocks rematerialise themselves (``nnx.remat``), as a plain model often does. On one
device, on a mesh of two, and over two processes (``tests/multiprocess_dropout_worker.py``, run by
``test_multiprocess.py``'s job of two processes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import max_rel_diff

import jax_dos

VOCAB, D, HEADS, LAYERS, SEQ, ROWS = 16, 8, 2, 2, 6, 4
LR, WD, B1, B2, CLIP = 1e-2, 0.1, 0.9, 0.95, 1.0
DROP = 0.25
LAYOUTS = ("list", "stack", "shared")  # the model's own streams
CALLED = ("called", "called_stack")  # the keys given at call time, model(tokens, rngs=rngs)


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, stream: str = "own"):
    self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)
    self.stream = stream
    if stream == "shared":  # the stream every module keeps
      self.rngs, self.drop = rngs, nnx.Dropout(DROP)
    elif stream == "called":  # no stream: the one the call gives
      self.drop = nnx.Dropout(DROP)
    else:  # its own stream, forked from rngs
      self.drop = nnx.Dropout(DROP, rngs=rngs)

  def dropped(self, x, rngs):
    return self.drop(x, rngs=self.rngs if self.stream == "shared" else rngs)

  @nnx.remat  # the counters' draws are found through jax.checkpoint too
  def __call__(self, x, rngs=None):
    b, t, _ = x.shape
    q, k, v = (a.reshape(b, t, HEADS, D // HEADS) for a in jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
    x = x + self.dropped(self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, D)), rngs)
    return x + self.dropped(self.down(jax.nn.gelu(self.up(self.norm2(x)))), rngs)


class Transformer(nnx.Module):
  """``layout``: ``list`` (each block its own stream), ``stack`` (a stack's streams split per layer), ``shared`` (an
  ``nnx.Rngs`` every module keeps), ``called`` and ``called_stack`` (no stream in the model: the keys given at call
  time, ``model(tokens, rngs=rngs)``; a stack's ``nnx.scan`` carries ``rngs``)."""

  def __init__(self, rngs: nnx.Rngs, layout: str):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.layout, self.stream = layout, {"shared": "shared", "called": "called", "called_stack": "called"}.get(
      layout, "own")  # fmt: skip
    if self.stacked:
      blocks = nnx.vmap(functools.partial(Block, stream=self.stream), in_axes=0, out_axes=0)
      self.blocks = nnx.split_rngs(splits=LAYERS)(blocks)(rngs)
    else:
      self.blocks = nnx.List([Block(rngs, self.stream) for _ in range(LAYERS)])
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    if self.stream == "shared":
      self.rngs, self.drop = rngs, nnx.Dropout(DROP)
    else:
      self.drop = nnx.Dropout(DROP, rngs=None if self.stream == "called" else rngs)

  @property
  def stacked(self) -> bool:
    return self.layout in ("stack", "called_stack")

  def dropped(self, x, rngs):
    return self.drop(x, rngs=self.rngs if self.stream == "shared" else rngs)

  def embedded(self, tokens, rngs=None):
    return self.dropped(self.embed(tokens), rngs)

  def logits(self, x, rngs=None):
    return self.embed.attend(self.dropped(self.norm(x), rngs))  # tied to the embedding

  def __call__(self, tokens, rngs=None):
    x = self.embedded(tokens, rngs)
    if self.stacked:
      x, _ = nnx.scan(lambda block, carry: (block(carry[0], rngs=carry[1]), carry[1]), in_axes=(0, nnx.Carry),
                      out_axes=nnx.Carry)(self.blocks, (x, rngs))  # fmt: skip
    else:
      for block in self.blocks:
        x = block(x, rngs=rngs)
    return self.logits(x, rngs)


def cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_fn(model, batch, rngs=None):
  return cross_entropy(model(batch[0], rngs=rngs), batch[1])


def embed(model, batch, rngs=None):
  return model.embedded(batch[0], rngs)


def head(model, x, batch, rngs=None):
  return cross_entropy(model.logits(x, rngs), batch[1])


def run_layer(layer, x, batch, rngs=None):  # a parameter named rngs is no layer index
  return layer(x) if rngs is None else layer(x, rngs=rngs)


def make_model(layout: str, dropout_seed: int = 1) -> Transformer:
  """The model: its parameters from ``params=0`` (the same for any ``dropout_seed``), its streams from the seed."""
  return Transformer(nnx.Rngs(params=0, dropout=dropout_seed), layout)


def call_rngs(layout: str, seed: int = 1) -> nnx.Rngs | None:
  """The keys ``layout``'s model is called with (``model(tokens, rngs=rngs)``): ``None`` where it keeps its own."""
  return nnx.Rngs(dropout=seed) if layout.startswith("called") else None


def staged_of(model, batch, rngs=None, **kwargs):
  block = run_layer if model.stacked else None
  given = dict(embed=embed, blocks="blocks", head=head, block=block, **({} if rngs is None else {"rngs": rngs}))
  return jax_dos.nnx_stages(model, batch, **{**given, **kwargs})


def make_batches(rng: np.random.Generator, steps: int) -> list:
  tokens = rng.integers(0, VOCAB, (steps, ROWS, SEQ + 1))
  return [(jnp.asarray(t[:, :-1], jnp.int32), jnp.asarray(t[:, 1:], jnp.int32)) for t in tokens]


def halves(batch):
  return [jax.tree.map(lambda a, m=m: a[m * ROWS // 2 : (m + 1) * ROWS // 2], batch) for m in range(2)]


@nnx.jit
def plain_loss_and_grads(model, batch, rngs=None):
  """The mean of the two micro-batches' losses and gradients, each ``nnx.value_and_grad`` of the model's own loss:
  two forward calls (``model(tokens, rngs=rngs)``: the one ``rngs`` counting on)."""
  pairs = [nnx.value_and_grad(loss_fn)(model, h, rngs) for h in halves(batch)]
  return jax.tree.map(lambda a, b: (a + b) / 2, *pairs)


def plain_grads(model, batch, rngs=None):
  return plain_loss_and_grads(model, batch, rngs)[1]


@nnx.jit
def plain_step(model, optimizer, batch, rngs=None):
  """One step of the plain path; the step's loss (the micro-batches' mean)."""
  loss, grads = plain_loss_and_grads(model, batch, rngs)
  optimizer.update(model, grads)
  return loss


def reference_steps(reference, optimizer, batches: list, rngs=None) -> tuple[list, list]:
  """The plain path's steps on ``batches``: their losses and each step's gradients (taken on clones of the model and
  of the keys, whose counters the step then advances from where they were: the same masks)."""
  losses, grads = [], []
  for batch in batches:
    clone = None if rngs is None else nnx.clone(rngs)
    grads.append(jax.tree.leaves(nnx.to_pure_dict(plain_grads(nnx.clone(reference), batch, clone))))
    losses.append(plain_step(reference, optimizer, batch, rngs))
  return losses, grads


# Adam's rounding, for within_adam_rounding: float32's unit roundoff; the gradient's rounding factor (below); the
# bounds of Adam's normalised step r = m/sqrt(v) (bias-corrected) over 3 steps of b1 = 0.9, b2 = 0.95.
U = 2.0**-24
GRAD_ROUNDING = 8 * ROWS * SEQ  # 192: both paths' sums of ROWS * SEQ tokens' terms, each term up to 4x the largest
R_MAX = 1.0008  # |r| <= sqrt(sum_s w_s^2 / u_s) (Cauchy-Schwarz, w and u the moments' weights of each step's g_s)
DR_DLOG_G = 2.01  # |g_s dr/dg_s| <= w_s / sqrt(u_s) + |r|


def within_adam_rounding(got, want, grads: list, lr: float = LR) -> float:
  """How far ``got`` is from ``want`` (the plain path's parameters after ``len(grads)`` AdamW steps whose gradients
  were ``grads``: leaves by step), as a share of the rounding the two paths' arithmetic allows each element; at most
  1 where they agree. Derived, not fitted:

  - The two paths sum each gradient in another order: element ``i`` of step ``s`` differs by at most
    ``d_s = GRAD_ROUNDING * U * G_s`` (``G_s`` the leaf's largest gradient), relatively by ``d_s / |g_si| + U`` (the
    clip's scale, a global norm summed in another order, adds ``U``).
  - Adam's step ``lr * r_t`` depends on the gradients through their ratios: ``r_t`` moves by at most ``DR_DLOG_G``
    times the sum of the relative changes of ``g_1 .. g_t``, and never by more than ``2 * R_MAX`` (a sign decided by
    rounding: an element whose gradient cancels to about zero).
  - The parameters themselves round: 2 ulps of ``max(|p|, 1)`` a step.

  Measured over 4 draws of each of the 5 layouts on one device, the differences used at most 3.4 % of what is
  allowed, and the plain path trained with another dropout seed (other masks) went 1.1e4 to 2.1e4 times over it. A fixed
  bound (2e-5) failed on a draw whose gradient cancelled in one element (4.2e-5 on a loaded machine): a sign there is
  rounding's to decide, and Adam's normalised step makes it an ``lr``-sized difference."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want) == len(grads[0]), (len(got), len(want), len(grads[0]))
  worst = 0.0
  for k, (x, y) in enumerate(zip(got, want)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if not x.size:
      continue
    relative, allowed = 0.0, len(grads) * 2 * np.spacing(np.maximum(np.abs(y), 1).astype(np.float32)).astype(float)
    for step in grads:
      g = np.abs(np.asarray(step[k], np.float64))
      relative = relative + GRAD_ROUNDING * U * g.max() / np.maximum(g, np.finfo(np.float64).tiny) + U
      allowed = allowed + lr * np.minimum(2 * R_MAX, DR_DLOG_G * relative)
    worst = max(worst, float(np.max(np.abs(x - y) / allowed)))
  return worst


def rng_state(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.RngCount))


def params(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("layout", LAYOUTS + CALLED)
def test_dropout_trains_through_the_stages_as_the_plain_nnx_model(layout):
  trains_as_the_plain_model(layout, make_batches(np.random.default_rng(), 3))


def trains_as_the_plain_model(layout: str, batches: list, place=lambda model: model) -> None:
  """Three steps of the overlapped step and of the plain path from one model (laid out by ``place``) on
  ``batches``: the same losses, the same parameters to float32 rounding and the same counters (the model's, and
  those of the keys it is called with)."""
  model, rngs = place(make_model(layout)), call_rngs(layout)
  reference, reference_rngs = nnx.clone(model), call_rngs(layout)
  optimizer = nnx.Optimizer(reference, optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(
    LR, b1=B1, b2=B2, weight_decay=WD)), wrt=nnx.Param)  # fmt: skip
  expected, grads = reference_steps(reference, optimizer, batches, reference_rngs)

  staged = staged_of(model, batches[0], rngs)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD)
  with jax_dos.OverlappedStep(tx, staged.stages, staged.give(model), clip_norm=CLIP, micro_batches=2) as step:
    losses = [step(batch) for batch in batches]
    staged.update(model, step.params)

  np.testing.assert_allclose(jax.device_get(losses), jax.device_get(expected), rtol=1e-5)
  assert within_adam_rounding(params(model), params(reference), grads) <= 1
  # The counters written back: the plain path's after 3 steps of 2 forward calls (2 draws a call from the
  # model's stream, 2 from each block's; all 6 from the one stream where they share it or the call gives it).
  listed = lambda tree: jax.tree.map(lambda a: np.asarray(a).tolist(), tree)  # noqa: E731
  assert listed(rng_state(model)) == listed(rng_state(reference))
  if rngs is not None:
    assert listed(rng_state(rngs)) == listed(rng_state(reference_rngs)) != listed(rng_state(call_rngs(layout)))
  assert all(st.inputs is not None for st in staged.stages)
  assert len({s.fn for s in staged.stages[1:-1]}) == 1  # one program for every layer


MESH_SCRIPT = """
import sys
sys.path.insert(0, "tests")
import jax, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import test_stage_rng as t

mesh = Mesh(np.array(jax.devices()[:2]), ("data",))  # 2 of the interpreter's 4
rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

def place(model):  # the parameters (and the streams' keys and counters) replicated over the mesh
  nnx.update(model, jax.device_put(nnx.state(model), replicated))
  return model

for layout in ("stack", "shared"):  # a stream split per layer, one stream counted on across the layers
  batches = [jax.device_put(b, rows) for b in t.make_batches(np.random.default_rng(), 3)]
  t.trains_as_the_plain_model(layout, batches, place)
  print("ok", layout)
"""


def test_dropout_on_a_data_parallel_mesh_is_the_plain_models(four_devices):
  """On 2 devices, the batch's rows over them and the model replicated, the stages draw the plain path's masks:
  the same numbers as the plain NNX model trained on the same mesh (a mask does not depend on the layout)."""
  result = four_devices.run(MESH_SCRIPT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("ok ") == 2, result.stdout


@pytest.mark.parametrize("layout", ["list", "called"])
def test_another_dropout_seed_draws_other_masks(layout):
  """The tests above can fail: the model with other streams (the same parameters), or called with other keys,
  trains to other numbers."""
  batches = make_batches(np.random.default_rng(), 2)
  model, other = make_model(layout), make_model(layout, dropout_seed=2)
  assert max_rel_diff(params(model), params(other)) == 0
  sums = []
  for m, rngs in ((model, call_rngs(layout)), (other, call_rngs(layout, seed=2))):
    staged = staged_of(m, batches[0], rngs)
    sums.append(staged.merge(jax_dos.StagedModel(staged.stages, staged.num_groups).loss_and_grads(
      staged.split(m), batches[0], micro_batches=2)[1]))  # fmt: skip
  plain = plain_grads(nnx.clone(model), batches[0], call_rngs(layout))
  expected = jax.tree.map(lambda g: 2 * g, nnx.to_pure_dict(plain))
  assert max_rel_diff(sums[0], expected) < 1e-5
  assert max_rel_diff(sums[1], expected) > 1e-2


@pytest.mark.parametrize("remat", ["full", "minimal", "none"])
@pytest.mark.parametrize("order", ["stage", "batch"])
@pytest.mark.parametrize("layout", ["list", "shared", "called"])
def test_a_recomputed_forward_draws_the_same_masks(remat, order, layout):
  """Under each rematerialisation policy and micro-batch order, the stages' gradients of a step and of the next
  are the plain path's: the backward program recomputes the forward with the forward's keys."""
  batches = make_batches(np.random.default_rng(), 2)
  model = make_model(layout)
  reference, reference_rngs = nnx.clone(model), call_rngs(layout)
  staged = staged_of(model, batches[0], call_rngs(layout))
  stages = [dataclasses.replace(st, remat=remat) for st in staged.stages]
  staged_model, groups = jax_dos.StagedModel(stages, staged.num_groups), staged.give(model)
  for batch in batches:
    _, sums = staged_model.loss_and_grads(groups, batch, micro_batches=2, order=order)
    staged_model.advance(2)  # as the overlapped step does after a step
    expected = jax.tree.map(lambda g: 2 * g, nnx.to_pure_dict(plain_grads(reference, batch, reference_rngs)))
    assert max_rel_diff(staged.merge(sums), expected) < 1e-5


def test_eval_mode_uses_no_randomness():
  """A model in eval mode (``nnx.Dropout`` deterministic) gives stages with no random inputs: any seed trains alike,
  as the plain path in eval mode."""
  batch = make_batches(np.random.default_rng(), 1)[0]
  got = []
  for seed in (1, 2):
    model = make_model("list", dropout_seed=seed)
    model.eval()
    staged = staged_of(model, batch)
    assert all(st.inputs is None for st in staged.stages)
    got.append(staged.merge(jax_dos.StagedModel(staged.stages, staged.num_groups).loss_and_grads(
      staged.split(model), batch, micro_batches=2)[1]))  # fmt: skip
  expected = jax.tree.map(lambda g: 2 * g, nnx.to_pure_dict(plain_grads(model, batch)))
  assert max_rel_diff(got[0], expected) < 1e-5 and max_rel_diff(got[1], got[0]) == 0


@pytest.mark.parametrize("layout", ["list", "called"])
def test_the_layer_index_reaches_a_block_that_takes_it(layout):
  """``block(layer, x, batch, index)``: the layer's index, an int32 scalar, in one program for every layer; and
  ``rngs=`` beside it where the model is called with keys (``block(layer, x, batch, index, rngs=rngs)``)."""
  batch = make_batches(np.random.default_rng(), 1)[0]
  model, rngs, plain_rngs = make_model(layout), call_rngs(layout), call_rngs(layout)
  if rngs is None:
    model.eval()
  staged = staged_of(model, batch, rngs, block=lambda layer, x, batch, index, rngs=None: layer(x, rngs=rngs) * (
    1 + index))  # fmt: skip
  assert len({s.fn for s in staged.stages[1:-1]}) == 1
  loss, _ = jax_dos.StagedModel(staged.stages, staged.num_groups).loss_and_grads(staged.split(model), batch)
  x = model.embedded(batch[0], plain_rngs)
  for i, block in enumerate(model.blocks):
    x = block(x, rngs=plain_rngs) * (1 + i)
  np.testing.assert_allclose(float(loss), float(cross_entropy(model.logits(x, plain_rngs), batch[1])), rtol=1e-6)


def test_keys_given_at_call_time_are_an_nnx_rngs_the_model_does_not_keep():
  """``rngs=`` takes the ``nnx.Rngs`` the model is called with: a bare key, or a stream the model keeps too, is
  refused with what to give instead."""
  batch = (jax.ShapeDtypeStruct((2, SEQ), jnp.int32),) * 2
  with pytest.raises(TypeError, match=r"rngs= takes the nnx.Rngs .*; got a key array. A bare key .*: give"
                     r" nnx.Rngs\(dropout=key\)"):  # fmt: skip
    staged_of(make_model("called"), batch, jax.random.key(0))
  model = make_model("shared")
  with pytest.raises(ValueError, match="rngs= is a stream the model also keeps.*leave rngs= out"):
    staged_of(model, batch, model.rngs)


class Normed(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([nnx.BatchNorm(D, rngs=rngs)])


class CountsByData(nnx.Module):
  """Counts its stream up by its input's data: no fixed number of draws per call."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear, self.stream = nnx.Linear(D, D, rngs=rngs), rngs.dropout.fork()

  def __call__(self, x):
    self.stream.count[...] += (jnp.sum(x) > 0).astype(jnp.uint32)
    return self.linear(x)


def unsplit_stack(rngs: nnx.Rngs) -> Transformer:
  model = Transformer(rngs, "stack")
  model.blocks.drop.rngs = rngs.dropout.fork()  # one stream for the whole stack: not a slice per layer
  return model


def counts_by_data(rngs: nnx.Rngs) -> Transformer:
  model = Transformer(rngs, "list")
  model.blocks = nnx.List([CountsByData(rngs) for _ in range(LAYERS)])
  return model


@pytest.mark.parametrize(
  "build, match",
  [
    (Normed, r"state other than nnx.Param and RNG streams: blocks/0/mean \(BatchStat\).*batch statistics"),
    (unsplit_stack, r"RNG stream blocks/drop/rngs/key of the stack 'blocks' is not split per layer \(leading axis"
     r" \[\] for 2 layers.*nnx.split_rngs\(splits=2\)"),
    (counts_by_data, r"block 0 advances an RNG counter by an amount that depends on its data"),
  ],
  ids=["batch_stats", "unsplit_stack", "counts_by_data"],
)  # fmt: skip
def test_what_the_adapter_refuses_of_a_models_state_says_what_to_change(build, match):
  model = build(nnx.Rngs(params=0, dropout=1))
  batch = (jax.ShapeDtypeStruct((2, SEQ), jnp.int32),) * 2
  with pytest.raises(ValueError, match=match):
    jax_dos.nnx_stages(model, batch, embed=embed, blocks="blocks", head=head, block=run_layer)
