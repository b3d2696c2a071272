"""Hugging Face checkpoints in and out (``models/hf.py``), against transformers' own Flax Llama.

transformers (before 5.0) runs its Flax Llama on jax and reads PyTorch-layout
safetensors (``from_pt=True``, one file). Its Flax rotary embedding uses the
base 10000 whatever ``rope_theta`` says, and it has no tied head and no
q/k/v-only biases, so the references are made as follows: for a Llama 3-style
checkpoint (``rope_theta`` 5e5), transformers' ``create_sinusoidal_positions``
with the config's base; for a Qwen2-style one (q/k/v biases, tied
embeddings), the same tensors as a Llama with ``attention_bias`` (the output
projection's bias zero) and the embedding written as its head.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from models import hf, llama

V, D, F, LAYERS, HEADS, KV = 64, 32, 48, 2, 4, 2


def write_checkpoint(folder: Path, kind: str, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
  """A tiny checkpoint in Hugging Face's names and layout: ``kind`` ``"llama3"`` (GQA, untied head, rope_theta 5e5),
  ``"qwen2"`` (q/k/v biases, tied embeddings) or ``"mistral"`` (rope_theta 1e4, a sliding window of 32 tokens of
  64); returns its tensors."""
  folder.mkdir(parents=True, exist_ok=True)
  qwen = kind == "qwen2"
  config = {
    "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": "qwen2" if qwen else "llama",
    "vocab_size": V, "hidden_size": D, "intermediate_size": F, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV, "hidden_act": "silu", "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6 if qwen else 1e-5, "rope_theta": 1e6 if qwen else 5e5, "tie_word_embeddings": qwen,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "use_cache": True,
  }  # fmt: skip
  if qwen:
    config.update(use_sliding_window=False, sliding_window=4096, max_window_layers=2)
  elif kind == "mistral":
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], rope_theta=10000.0, sliding_window=32)
  else:
    config.update(attention_bias=False, mlp_bias=False)
  (folder / "config.json").write_text(json.dumps(config))
  hd = D // HEADS
  w = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(dtype)  # noqa: E731
  t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": (1 + w(D)).astype(dtype)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    t.update({p + "self_attn.q_proj.weight": w(D, D), p + "self_attn.k_proj.weight": w(KV * hd, D),
              p + "self_attn.v_proj.weight": w(KV * hd, D), p + "self_attn.o_proj.weight": w(D, D),
              p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
              p + "mlp.down_proj.weight": w(D, F),
              p + "input_layernorm.weight": (1 + w(D)).astype(dtype),
              p + "post_attention_layernorm.weight": (1 + w(D)).astype(dtype)})  # fmt: skip
    if qwen:
      t.update({p + "self_attn.q_proj.bias": w(D), p + "self_attn.k_proj.bias": w(KV * hd),
                p + "self_attn.v_proj.bias": w(KV * hd)})  # fmt: skip
  if not qwen:
    t["lm_head.weight"] = w(V, D)
  save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
  return t


def reference_logits(folder: Path, tokens: np.ndarray, monkeypatch) -> np.ndarray:
  """transformers' Flax Llama's logits for the checkpoint in ``folder`` (the module docstring says how)."""
  import transformers.models.llama.modeling_flax_llama as flax_llama
  from transformers import FlaxLlamaForCausalLM, FlaxMistralForCausalLM

  config = json.loads((folder / "config.json").read_text())
  if config["model_type"] == "mistral":  # rope_theta 1e4, transformers' own base: its model as it is
    return np.asarray(FlaxMistralForCausalLM.from_pretrained(folder, from_pt=True)(tokens).logits)
  tensors = _read(folder / "model.safetensors")
  ref = folder.parent / (folder.name + "_reference")
  ref.mkdir(exist_ok=True)
  if config["model_type"] == "qwen2":
    for i in range(config["num_hidden_layers"]):
      tensors[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros(config["hidden_size"], np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    config.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True,
                  tie_word_embeddings=False)  # fmt: skip
  (ref / "config.json").write_text(json.dumps(config))
  contiguous = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  save_file(contiguous, ref / "model.safetensors", metadata={"format": "pt"})
  theta = config["rope_theta"]

  def positions(num_pos, dim):  # transformers' create_sinusoidal_positions, with the config's base
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
    freqs = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq).astype("float32")
    emb = np.concatenate((freqs, freqs), axis=-1)
    out = np.concatenate((np.sin(emb)[:, None, :], np.cos(emb)[:, None, :]), axis=-1)
    return jnp.array(out[:, :, :num_pos])

  monkeypatch.setattr(flax_llama, "create_sinusoidal_positions", positions)
  model = FlaxLlamaForCausalLM.from_pretrained(ref, from_pt=True)
  return np.asarray(model(tokens).logits)


def _read(file: Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return dict(load_file(file))


def _close(ours: np.ndarray, theirs: np.ndarray) -> None:
  """Within 1e-4 of the reference's scale."""
  scale = float(np.max(np.abs(theirs)))
  assert float(np.max(np.abs(ours - theirs))) <= 1e-4 * scale, (float(np.max(np.abs(ours - theirs))), scale)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral"])
def test_load_gives_transformers_logits_and_save_round_trips(tmp_path, monkeypatch, kind):
  rng = np.random.default_rng()
  folder = tmp_path / kind
  write_checkpoint(folder, kind, rng)
  tokens = rng.integers(0, V, (2, 12)).astype(np.int32)
  model = hf.load(folder)
  if kind == "mistral":  # its window is the longest sequence it takes
    assert model.cfg.block_size == 32
    with pytest.raises(ValueError, match="sequence length 40 exceeds block_size 32"):
      model(jnp.zeros((1, 40), jnp.int32))
  assert model.cfg.qkv_bias == (kind == "qwen2") and model.cfg.tie_embeddings == (kind == "qwen2")
  ours = np.asarray(model(jnp.asarray(tokens)))
  _close(ours, reference_logits(folder, tokens, monkeypatch))
  saved = hf.save(model, tmp_path / "saved")
  again = hf.load(saved)
  np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens))), ours)
  written = _read(saved / "model.safetensors")
  original = _read(folder / "model.safetensors")
  assert sorted(written) == sorted(original)  # the same names: a tied head is not written
  for name, value in original.items():
    np.testing.assert_array_equal(written[name], value)


def test_sharded_checkpoints_load_and_save_shard_by_shard(tmp_path, monkeypatch):
  rng = np.random.default_rng()
  write_checkpoint(tmp_path / "one", "llama3", rng, dtype=np.float32)
  model = hf.load(tmp_path / "one", dtype="float32", param_dtype="bfloat16")  # read into another dtype
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx_params(model)))
  monkeypatch.setattr(hf, "SHARD_BYTES", 16 * 1024)
  saved = hf.save(model, tmp_path / "sharded")
  index = json.loads((saved / hf.INDEX).read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and not (saved / hf.WEIGHTS).exists()
  tokens = jnp.asarray(rng.integers(0, V, (1, 10)), jnp.int32)
  np.testing.assert_array_equal(np.asarray(hf.load(saved, dtype="float32", param_dtype="bfloat16")(tokens)),
                                np.asarray(model(tokens)))  # fmt: skip
  (saved / shards[1]).unlink()
  with pytest.raises(hf.CheckpointError, match=f"names shards that are not there: .*{shards[1]}"):
    hf.load(saved)


def nnx_params(model):
  from flax import nnx

  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_bad_checkpoints_are_refused_naming_what(tmp_path):
  rng = np.random.default_rng()
  folder = tmp_path / "c"
  tensors = write_checkpoint(folder, "llama3", rng)
  config = json.loads((folder / "config.json").read_text())

  def with_config(**fields):
    (folder / "config.json").write_text(json.dumps({**config, **fields}))

  with_config(model_type="gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(hf.CheckpointError, match="model_type 'gpt2'.*Llama family"):
    hf.load(folder)
  with_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(hf.CheckpointError, match="rope_scaling of type 'yarn'"):
    hf.load(folder)
  with_config(quantization_config={"quant_method": "gptq"})
  with pytest.raises(hf.CheckpointError, match="quantization_config is not expressible"):
    hf.load(folder)
  with_config(mlp_bias=True)
  with pytest.raises(hf.CheckpointError, match="mlp_bias=True"):
    hf.load(folder)
  with_config()
  wrong = dict(tensors, **{"model.layers.1.mlp.up_proj.weight": np.zeros((F + 1, D), np.float32)})
  save_file(wrong, folder / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=r"model.layers.1.mlp.up_proj.weight has shape \[49, 32\].*\[48, 32\]"):
    hf.load(folder)
  del wrong["model.norm.weight"]
  wrong["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(wrong, folder / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match="no tensor model.norm.weight"):
    hf.load(folder)
  (folder / "model.safetensors").unlink()
  with pytest.raises(hf.CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
    hf.load(folder)


def test_llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones():
  """Llama 3's rule: wavelengths under ``original / high`` unchanged, over ``original / low`` divided by the factor,
  and between them a blend that meets both ends."""
  head_dim, theta, scaling = 128, 5e5, (8.0, 1.0, 4.0, 8192)
  plain = np.asarray(llama.rope_frequencies(head_dim, theta))
  scaled = np.asarray(llama.rope_frequencies(head_dim, theta, scaling))
  wavelength = 2 * np.pi / plain
  short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
  assert short.any() and long.any() and (~short & ~long).any()
  np.testing.assert_array_equal(scaled[short], plain[short])
  np.testing.assert_allclose(scaled[long], plain[long] / 8.0, rtol=1e-6)
  between = scaled[~short & ~long]
  assert np.all(between <= plain[~short & ~long]) and np.all(between >= plain[~short & ~long] / 8.0)
  cfg = hf.llama_config({"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {
                           "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}})  # fmt: skip
  assert (cfg.rope_scaling_factor, cfg.rope_original_context) == (8.0, 8192)
  assert hf.hf_config(cfg)["rope_scaling"]["factor"] == 8.0


SHARDED_LOAD = """
import sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from pathlib import Path
sys.path.insert(0, "tests")
from models import hf
folder = Path(sys.argv[1])
cfg = hf.llama_config(hf.read_config(folder), param_dtype="bfloat16")
mesh = jax.make_mesh((2, 2), ("data", "fsdp"))
def sharding(path, leaf):  # matrices split on both axes, the transposed ones included; one in pinned host memory
  keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
  kind = "pinned_host" if keys[-2:] == ["w_down", "kernel"] else None
  spec = P("fsdp", "data") if leaf.ndim == 2 else P()
  return NamedSharding(mesh, spec, memory_kind=kind)
from models import llama
shardings = jax.tree_util.tree_map_with_path(sharding, llama.abstract_params(cfg))
sharded = hf.load_params(folder, cfg, shardings)
plain = hf.load_params(folder, cfg)
leaves = zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree.leaves(plain), jax.tree.leaves(shardings))
for (path, a), b, s in leaves:
  assert a.sharding == s, (path, a.sharding, s)
  assert a.dtype == b.dtype == np.dtype("bfloat16"), (path, a.dtype)
  np.testing.assert_array_equal(np.asarray(a.astype("float32")), np.asarray(b.astype("float32")), err_msg=str(path))
print("ok", len(jax.tree.leaves(sharded)))
"""


def test_a_checkpoint_loads_into_any_sharding_and_memory(tmp_path, four_devices):
  """Each tensor goes straight into its sharding: a named sharding of the transposed kernels (the devices transpose
  them), one in pinned host memory, on a 2 x 2 mesh of CPU devices, equal to the one-device read."""
  write_checkpoint(tmp_path / "c", "llama3", np.random.default_rng(), dtype=np.float32)
  out = four_devices.run(SHARDED_LOAD, str(tmp_path / "c"), timeout=300)
  assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
