"""models/llama.py: shapes and counts from the config, Llama 2 7B's shape, the named matmul outputs, attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import llama as L

SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, block_size=16)


@pytest.mark.parametrize("preset", sorted(L.PRESETS))
def test_param_count_matches_abstract_model(preset):
  cfg = L.get_config(preset, param_dtype="bfloat16", n_layer=2)  # two blocks of the preset's widths
  tree = L.abstract_params(cfg)  # nnx.eval_shape: nothing allocated
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in jax.tree.leaves(tree))
  assert L.tree_size(tree) == L.param_count(cfg)


def test_the_7b_preset_is_llama_2_7b():
  cfg = L.get_config("llama-7b")
  assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.hidden_dim, cfg.vocab_size) == (
    4096, 32, 32, 32, 11008, 32000,
  )  # fmt: skip
  assert L.param_count(cfg) == 6_738_415_616  # Llama 2 7B's 6.74B
  assert L.get_config("llama-1.1b").hidden_dim == 5632  # TinyLlama's


def test_large_matmul_outputs_carry_the_remat_names():
  cfg = L.get_config("tiny", **SMALL)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: L.Llama(cfg, nnx.Rngs(0))))
  x = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  text = str(jax.make_jaxpr(jax.grad(L.make_loss_fn(graphdef)))(L.abstract_params(cfg), (x, x)))  # traced only
  for name in ("qkv_proj", "out_proj", "mlp_in", "mlp_out"):
    assert f"name={name}" in text
  per_block = {n: text.count(f"name={n}") for n in ("qkv_proj", "out_proj", "mlp_in", "mlp_out")}
  assert per_block == {"qkv_proj": 3 * 2, "out_proj": 2, "mlp_in": 2 * 2, "mlp_out": 2}


@jax.jit
def _logits(graphdef, params, tokens):
  return nnx.merge(graphdef, params)(tokens)


def test_attention_is_causal_grouped_query_is_repeated_heads_and_the_first_loss_is_log_vocab():
  rng = np.random.default_rng()
  cfg = L.get_config("tiny", **SMALL)
  graphdef, params = L.init_params(cfg, seed=int(rng.integers(2**31)))
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % cfg.vocab_size)
  logits, later = _logits(graphdef, params, tokens), _logits(graphdef, params, changed)
  np.testing.assert_allclose(logits[:, :8], later[:, :8], rtol=1e-5, atol=1e-6)
  assert not np.allclose(logits[:, 8:], later[:, 8:])
  assert abs(float(L.cross_entropy(logits, tokens)) - np.log(cfg.vocab_size)) < 0.1
  # The same model with every key/value head repeated for its query heads: multi-head attention.
  full_cfg = L.get_config("tiny", **{**SMALL, "n_kv_head": 4})
  full_graphdef, _ = nnx.split(nnx.eval_shape(lambda: L.Llama(full_cfg, nnx.Rngs(0))), nnx.Param)
  full = jax.tree.map(lambda a: a, params)
  for block in full["blocks"].values():
    for name in ("wk", "wv"):
      kernel = block["attn"][name]["kernel"].reshape(cfg.d_model, cfg.n_kv_head, cfg.head_dim)
      block["attn"][name]["kernel"] = jnp.repeat(kernel, 2, axis=1).reshape(cfg.d_model, -1)
  np.testing.assert_allclose(_logits(full_graphdef, full, tokens), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "kwargs, match",
  [(dict(n_head=3, d_model=33), "heads of an even width"), (dict(n_head=4, n_kv_head=3), "multiple of n_kv_head")],
)
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    L.get_config("tiny", **kwargs)
