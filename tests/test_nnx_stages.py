"""``jax_dos.nnx_stages``: a user's own Flax NNX transformer trained by ``OverlappedStep`` through its own modules.

The model is written here, as a user would: token embedding, pre-norm blocks (causal attention, MLP), a final norm
and a head tied to the embedding (``nnx.Embed.attend``). Its blocks are an ``nnx.List`` or one stack made with
``nnx.vmap`` and run with ``nnx.scan``. The reference is ``optax.chain(clip_by_global_norm, adamw)`` on the model's
own ``__call__``: ``jax.grad`` of each micro-batch's loss, their mean. The attention has no biases (a key bias has
no gradient mathematically, and Adam turns its rounding noise into whole steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import max_rel_diff

import jax_dos
from jax_dos.hand_off import HandOffError

VOCAB, D, HEADS, LAYERS, SEQ, ROWS = 16, 8, 2, 2, 6, 4
LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.95
FIRES, SILENT = 1e-3, 1e6  # clip norms: one every step's gradient exceeds, one none does


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    q, k, v = (a.reshape(b, t, HEADS, D // HEADS) for a in jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
    x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, D))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, stacked: bool):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.stacked = stacked
    if stacked:
      self.blocks = nnx.split_rngs(splits=LAYERS)(nnx.vmap(Block, in_axes=0, out_axes=0))(rngs)
    else:
      self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.norm = nnx.RMSNorm(D, rngs=rngs)

  def logits(self, x):
    return self.embed.attend(self.norm(x))  # tied to the embedding

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.stacked:
      x = nnx.scan(lambda block, x: block(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)
    else:
      for block in self.blocks:
        x = block(x)
    return self.logits(x)


def cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def embed(model, batch):
  return model.embed(batch[0])


def head(model, x, batch):
  return cross_entropy(model.logits(x), batch[1])


def run_layer(layer, x, batch):
  return layer(x)


def make_model(rng: np.random.Generator, stacked: bool) -> Transformer:
  """The model with fresh random parameters: shapes from ``nnx.eval_shape`` (no initializer runs), values drawn
  here, norm scales near 1."""
  model = nnx.eval_shape(lambda: Transformer(nnx.Rngs(0), stacked))

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape)
    if path[-1].key == "scale":
      return jnp.asarray(1 + 0.1 * noise, leaf.dtype)
    return jnp.asarray(noise / np.sqrt(leaf.shape[-2] if leaf.ndim > 1 else 10), leaf.dtype)

  nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
  return model


def make_batches(rng: np.random.Generator, steps: int) -> list:
  tokens = rng.integers(0, VOCAB, (steps, ROWS, SEQ + 1))
  return [(jnp.asarray(t[:, :-1], jnp.int32), jnp.asarray(t[:, 1:], jnp.int32)) for t in tokens]


@jax.jit
def reference_step(graphdef, params: dict, state, batch, clip: jax.Array):
  """One step of ``optax.chain(clip_by_global_norm, adamw)`` on the model's own loss, fed the two micro-batches."""
  ref = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD))
  loss = lambda p, b: cross_entropy(nnx.merge(graphdef, p)(b[0]), b[1])  # noqa: E731
  halves = [jax.tree.map(lambda a, m=m: a[m * ROWS // 2 : (m + 1) * ROWS // 2], batch) for m in range(2)]
  grads = jax.tree.map(lambda a, b: (a + b) / 2, *(jax.grad(loss)(params, h) for h in halves))
  updates, state = ref.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def reference(model, batches: list, clip: float) -> dict:
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params))
  state = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(LR)).init(params)
  for batch in batches:
    params, state = reference_step(graphdef, params, state, batch, jnp.float32(clip))
  return params


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stack"])
@pytest.mark.parametrize("clip", [FIRES, SILENT], ids=["clip_fires", "clip_silent"])
def test_a_users_transformer_trains_through_the_adapter_as_optax(stacked, clip):
  rng = np.random.default_rng()
  model, batches = make_model(rng, stacked), make_batches(rng, 3)
  expected = reference(model, batches, clip)

  # The adapter, as a user writes it: the model's own modules, its parameters written back.
  layer = run_layer if stacked else None  # a layer's own call, given (the stack) or the default (the list)
  staged = jax_dos.nnx_stages(model, batches[0], embed=embed, blocks="blocks", head=head, block=layer)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD)
  with jax_dos.OverlappedStep(tx, staged.stages, staged.give(model), clip_norm=clip, micro_batches=2) as step:
    losses = [step(batch) for batch in batches]
    with pytest.raises(HandOffError, match=r"parameter embed/embedding was handed to the overlapped step .*"
                       r"staged.update\(model, step.params\)"):  # fmt: skip
      model(batches[0][0])  # the step holds the model's arrays (and has donated them)
    staged.update(model, step.params)

  assert max_rel_diff(nnx.to_pure_dict(nnx.state(model, nnx.Param)), expected) < 2e-5
  assert np.all(np.isfinite(jax.device_get(losses)))
  fired = step.grad_norm >= clip
  assert bool(fired) == (clip == FIRES)
  assert len(staged.stages) == LAYERS + 2 and staged.stacked == stacked
  assert len({s.fn for s in staged.stages[1:-1]}) == 1  # one program for every layer
  assert staged.stages[-1].groups == (LAYERS + 1, 0)  # the tied head reads the embedding's group


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stack"])
def test_a_restore_template_in_the_models_own_layout(stacked, tmp_path):
  """``staged.merge`` of ``jax_dos.abstract_state``'s groups: the state's shapes, dtypes, shardings and memory kinds
  in the model's own layout (a stack's layers stacked again), which a checkpoint saved in that layout restores into,
  one of plain optax's included."""
  rng = np.random.default_rng()
  model, batches = make_model(rng, stacked), make_batches(rng, 1)
  staged = jax_dos.nnx_stages(model, batches[0], embed=embed, blocks="blocks", head=head,
                              block=run_layer if stacked else None)  # fmt: skip
  groups = staged.split(model)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, plan="host")
  plan = jax_dos.overlapped_plan(tx, staged.stages, groups)
  template = jax_dos.abstract_state(plan, groups)
  in_layout = jax_dos.InterleavedAdamState(template.count, *(staged.merge(t) for t in template[1:]))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for tree in in_layout[1:]:
    assert jax.tree.structure(tree) == jax.tree.structure(params)
    for t, p in zip(jax.tree.leaves(tree), jax.tree.leaves(params)):
      assert isinstance(t, jax.ShapeDtypeStruct) and t.shape == p.shape and t.sharding.memory_kind == "pinned_host"
  ref = optax.adamw(LR)
  with jax_dos.CheckpointManager(str(tmp_path / "ckpt")) as manager:
    manager.save(1, params=params, opt_state=ref.init(params), force=True)
  with jax_dos.CheckpointManager(str(tmp_path / "ckpt")) as manager:
    restored, state, _ = manager.restore(params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=x.sharding), params), opt_state=in_layout)  # fmt: skip
  assert max_rel_diff(state.master, params) == 0


class Unstacked(Transformer):
  def __init__(self, rngs: nnx.Rngs):
    super().__init__(rngs, stacked=False)
    self.blocks = Block(rngs)  # one block: not a stack


@pytest.mark.parametrize(
  "build, kwargs, match",
  [
    (lambda rngs: Transformer(rngs, False), dict(blocks="layers"), "no attribute 'layers'"),
    (lambda rngs: Unstacked(rngs), {}, r"taken as a stack of layers .* leading axes are \['16', '8'\]"),
    (lambda rngs: Transformer(rngs, False), dict(embed=lambda m, b: m.blocks[0](m.embed(b[0]))), "reads the blocks"),
    (lambda rngs: Transformer(rngs, False), dict(head=lambda m, x, b: m.logits(x)), "scalar loss"),
  ],
  ids=["no_attribute", "one_block", "embed_reads_blocks", "head_not_a_loss"],
)
def test_what_the_adapter_refuses_says_what_to_change(build, kwargs, match):
  model = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
  batch = (jax.ShapeDtypeStruct((2, SEQ), jnp.int32),) * 2
  with pytest.raises(ValueError, match=match):
    jax_dos.nnx_stages(model, batch, **{**dict(embed=embed, blocks="blocks", head=head), **kwargs})


def test_an_example_batch_not_the_steps_says_which_stage_failed_and_on_what():
  """The tokens alone where each step's batch is ``(tokens, targets)``: embed reads the first row, the block gets a
  2-D input; the error names the block, the shapes it got, the example batch and what to pass."""
  model = nnx.eval_shape(lambda: Transformer(nnx.Rngs(0), False))
  tokens = jax.ShapeDtypeStruct((2, SEQ), jnp.int32)
  match = (
    rf"block 0 on embed's output float32\[{SEQ}, {D}\] failed on the example batch int32\[2, {SEQ}\]"
    r".*not the tokens alone"
  )
  with pytest.raises(ValueError, match=match):
    jax_dos.nnx_stages(model, tokens, embed=embed, blocks="blocks", head=head)


def test_give_leaves_the_model_unusable_until_update_and_split_leaves_it_alone():
  rng = np.random.default_rng()
  model, batches = make_model(rng, stacked=True), make_batches(rng, 1)
  staged = jax_dos.nnx_stages(model, batches[0], embed=embed, blocks="blocks", head=head, block=run_layer)
  before = model(batches[0][0])
  groups = staged.split(model)  # for plans and templates: the model stays usable
  np.testing.assert_array_equal(np.asarray(model(batches[0][0])), np.asarray(before))
  given = staged.give(model)
  for use in (lambda: model(batches[0][0]), lambda: jax.jit(lambda: model(batches[0][0]))()):
    with pytest.raises(HandOffError, match="blocks/.* was handed to the overlapped step|embed/embedding was handed"):
      use()
  staged.update(model, given)  # the same parameters back, untrained
  np.testing.assert_array_equal(np.asarray(model(batches[0][0])), np.asarray(before))
  assert len(groups) == len(given)
  with pytest.raises(TypeError, match="takes the flax.nnx.Module itself"):
    staged.give(nnx.state(model, nnx.Param))
