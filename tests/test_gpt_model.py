"""models/gpt.py: shapes, parameter and FLOP counts, causality, precision options, the pure loss."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import gpt as G

SMALL = dict(n_layer=2, n_head=2, d_model=32, block_size=16)


def _tokens(rng: np.random.Generator, cfg: G.GPTConfig, batch: int = 2, t: int | None = None) -> jax.Array:
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, t or cfg.block_size)), jnp.int32)


@pytest.mark.parametrize("preset", sorted(G.PRESETS))
def test_param_count_matches_abstract_model(preset):
  cfg = G.get_config(preset, vocab_size=50304, param_dtype="bfloat16")
  tree = G.abstract_params(cfg)  # nnx.eval_shape: nothing allocated, even for gpt-6.7b
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in jax.tree.leaves(tree))
  assert G.tree_size(tree) == G.param_count(cfg)


def test_big_presets_have_the_documented_shape():
  # Each name states its size: the count must round to it (GPT-2 vocabulary, 50257 tokens).
  for preset, billions in [("gpt2-124m", 0.124), ("gpt2-350m", 0.355), ("gpt-1.3b", 1.3), ("gpt-2.7b", 2.7),
                           ("gpt-6.7b", 6.7), ("gpt-30b", 30.0)]:  # fmt: skip
    n = G.param_count(G.get_config(preset, vocab_size=50257)) / 1e9
    assert abs(n - billions) / billions < 0.08, (preset, n)


@pytest.mark.parametrize(
  "overrides",
  [dict(), dict(bias=False), dict(norm="rmsnorm"), dict(bias=False, norm="rmsnorm"), dict(vocab_size=300)],
)
def test_param_count_matches_real_model(overrides):
  cfg = G.get_config("tiny", **{**SMALL, **overrides})
  _, params = G.init_params(cfg)
  assert G.tree_size(params) == G.param_count(cfg)
  abstract = G.abstract_params(cfg)
  assert jax.tree.structure(abstract) == jax.tree.structure(params)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), params)


def test_flops_per_token_matches_xla_cost_analysis():
  # Wide enough that matmuls dominate XLA's count of the whole gradient step (elementwise ops are the rest).
  cfg = G.get_config("tiny", n_layer=2, n_head=4, d_model=256, block_size=64)
  graphdef, params = G.init_params(cfg)
  x = jnp.zeros((4, 64), jnp.int32)
  compiled = jax.jit(jax.value_and_grad(G.make_loss_fn(graphdef))).lower(params, (x, x)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla = cost["flops"] / x.size
  assert abs(xla - G.flops_per_token(cfg, 64)) / xla < 0.1, (xla, G.flops_per_token(cfg, 64))
  # The attention term grows with the sequence length as 12 L d T.
  assert G.flops_per_token(cfg, 64) - G.flops_per_token(cfg, 32) == 12 * cfg.n_layer * cfg.d_model * 32


@pytest.mark.parametrize(
  "dtype, param_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]
)
def test_shapes_and_dtypes(dtype, param_dtype):
  cfg = G.get_config("tiny", **SMALL, dtype=dtype, param_dtype=param_dtype)
  graphdef, params = G.init_params(cfg)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}
  x = _tokens(np.random.default_rng(0), cfg, t=cfg.block_size - 3)
  logits = jax.jit(lambda p, x: G.nnx.merge(graphdef, p)(x))(params, x)
  assert logits.shape == (2, cfg.block_size - 3, cfg.vocab_size)
  assert logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_sequence_longer_than_block_is_an_error():
  cfg = G.get_config("tiny", **SMALL)
  graphdef, params = G.init_params(cfg)
  with pytest.raises(ValueError, match="exceeds block_size"):
    G.nnx.merge(graphdef, params)(jnp.zeros((1, cfg.block_size + 1), jnp.int32))


def test_attention_is_causal():
  cfg = G.get_config("tiny", **SMALL)
  graphdef, params = G.init_params(cfg, seed=1)
  rng = np.random.default_rng(1)
  x = _tokens(rng, cfg)
  y = x.at[:, 9:].set(_tokens(rng, cfg)[:, 9:])  # change the future only
  model = G.nnx.merge(graphdef, params)
  a, b = model(x), model(y)
  np.testing.assert_array_equal(np.asarray(a[:, :9]), np.asarray(b[:, :9]))
  assert not np.allclose(np.asarray(a[:, 9:]), np.asarray(b[:, 9:]))


def test_loss_is_mean_cross_entropy_near_log_vocab_at_init():
  cfg = G.get_config("tiny", **SMALL)
  graphdef, params = G.init_params(cfg)
  rng = np.random.default_rng(2)
  x, y = _tokens(rng, cfg), _tokens(rng, cfg)
  loss = G.make_loss_fn(graphdef)(params, (x, y))
  logits = G.nnx.merge(graphdef, params)(x)
  ref = optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, cfg.vocab_size)).mean()
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
  assert loss.dtype == jnp.float32
  assert abs(float(loss) - math.log(cfg.vocab_size)) < 0.2  # small init: nearly uniform predictions


def test_every_remat_policy_gives_the_same_loss_and_gradients():
  """The plain step under each block policy against keeping every activation ("none"), to float32 rounding."""
  rng = np.random.default_rng()
  cfg = G.get_config("tiny", **SMALL)
  x, y = _tokens(rng, cfg), _tokens(rng, cfg)
  out = {}
  for policy in ("none", "full", "minimal", "offload"):
    graphdef, params = G.init_params(G.get_config("tiny", **SMALL, remat=policy), seed=4)
    out[policy] = jax.jit(jax.value_and_grad(G.make_loss_fn(graphdef)))(params, (x, y))
  for policy in ("full", "minimal", "offload"):
    np.testing.assert_allclose(float(out[policy][0]), float(out["none"][0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[policy][1]), jax.tree.leaves(out["none"][1])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_remat_config_takes_a_policy_name_or_a_bool():
  assert G.get_config("tiny", remat=True).remat == "full" and G.get_config("tiny", remat=False).remat == "none"
  with pytest.raises(ValueError, match="GPTConfig.remat must be one of"):
    G.get_config("tiny", remat="some")


def test_bfloat16_compute_is_close_to_float32():
  rng = np.random.default_rng(5)
  cfg32 = G.get_config("tiny", **SMALL)
  x, y = _tokens(rng, cfg32), _tokens(rng, cfg32)
  losses = []
  for dtype in ("float32", "bfloat16"):
    graphdef, params = G.init_params(G.get_config("tiny", **SMALL, dtype=dtype), seed=6)
    losses.append(float(jax.jit(G.make_loss_fn(graphdef))(params, (x, y))))
  assert abs(losses[0] - losses[1]) < 0.02, losses


def test_weight_tying_head_uses_token_embedding():
  cfg = G.get_config("tiny", **SMALL)
  graphdef, params = G.init_params(cfg)
  rng = np.random.default_rng(7)
  x = _tokens(rng, cfg)
  scaled = jax.tree.map(lambda a: a, params)
  scaled["wte"]["embedding"] = params["wte"]["embedding"] * 0  # no embedding -> no head -> all-zero logits
  logits = G.nnx.merge(graphdef, scaled)(x)
  np.testing.assert_array_equal(np.asarray(logits), 0.0)
  assert "lm_head" not in params


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(d_model=30, n_head=4), "divisible"),
    (dict(norm="batchnorm"), "norm must be"),
    (dict(dtype="float16"), "dtype must be"),
    (dict(n_layer=0), "positive integer"),
  ],
)
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    G.GPTConfig(**kwargs)


def test_unknown_preset_lists_the_choices():
  with pytest.raises(ValueError, match="gpt2-124m"):
    G.get_config("gpt-9000")
