"""Checkpoints that transformers 5 writes, against logits it computed: ``tests/fixtures/hf5`` (made by its PyTorch
models, ``make_fixtures.py``; no torch here), one tiny seeded checkpoint a family, in transformers 5's config spelling;
the same models in transformers 4's spelling (its config classes, where it is installed); what ``models.hf.save``
writes, read back; and the Flax layout of transformers 4's Flax models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import hf

FIXTURES = Path(__file__).parent / "fixtures" / "hf5"
SPEC = json.loads((FIXTURES / "spec.json").read_text())
FAMILIES = sorted(SPEC["families"])


def reference(family: str) -> tuple[np.ndarray, np.ndarray]:
  ref = np.load(FIXTURES / family / "reference.npz")
  return ref["tokens"].astype(np.int32), ref["logits"]


def assert_close(ours: np.ndarray, theirs: np.ndarray, tol: float = 1e-5) -> None:
  """Within ``tol`` of the reference's scale (its largest magnitude)."""
  scale = float(np.abs(theirs).max())
  error = float(np.abs(ours - theirs).max())
  assert error <= tol * scale, (error, scale)


def logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(hf.load(folder)(jnp.asarray(tokens)))


def transformers4():
  """transformers before 5 (CI's: its config classes write transformers 4's spelling), or a skip."""
  transformers = pytest.importorskip("transformers")
  if int(transformers.__version__.split(".")[0]) >= 5:
    pytest.skip(f"transformers {transformers.__version__} writes transformers 5's spelling")
  return transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers5_checkpoints_give_its_logits(family):
  config = json.loads((FIXTURES / family / "config.json").read_text())
  assert "rope_parameters" in config and "rope_theta" not in config and "dtype" in config  # 5's spelling
  tokens, theirs = reference(family)
  model = hf.load(FIXTURES / family)
  assert (model.cfg.qk_norm, model.cfg.qkv_bias) == (family == "qwen3", family == "qwen2")
  assert model.cfg.tie_embeddings == config["tie_word_embeddings"]
  assert model.cfg.head_dim == (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
  assert_close(np.asarray(model(jnp.asarray(tokens))), theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers4_spelling_of_the_same_models_reads_alike(tmp_path, family):
  """transformers 4's config class of the same model (``rope_theta``/``rope_scaling``, ``torch_dtype``) beside the
  same weights gives the same model."""
  transformers = transformers4()
  spec = SPEC["families"][family]
  if not hasattr(transformers, spec["class"]):
    pytest.skip(f"transformers {transformers.__version__} has no {spec['class']}")
  config = getattr(transformers, spec["class"])(**spec["v4"], torch_dtype="float32")
  config.architectures = [hf.ARCHITECTURES[config.model_type]]
  config.save_pretrained(tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert "rope_theta" in written and "rope_parameters" not in written
  shutil.copy(FIXTURES / family / "model.safetensors", tmp_path)
  assert hf.llama_config(written) == hf.llama_config(hf.read_config(FIXTURES / family))
  tokens, theirs = reference(family)
  assert_close(logits(tmp_path, tokens), theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_writes_a_config_both_spellings_read_and_keeps_the_ids(tmp_path, family):
  source = hf.read_config(FIXTURES / family)
  model = hf.load(FIXTURES / family)
  saved = hf.save(model, tmp_path / "saved", source=source, dtype="bfloat16")
  config = json.loads((saved / "config.json").read_text())
  assert config["model_type"] == source["model_type"] and config["architectures"] == source["architectures"]
  for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "sliding_window"):
    assert config.get(key) == source.get(key), key
  assert config["torch_dtype"] == config["dtype"] == "bfloat16"
  assert {str(v.dtype) for v in load_file(saved / "model.safetensors").values()} == {"bfloat16"}
  generation = json.loads((saved / "generation_config.json").read_text())
  assert generation["eos_token_id"] == source["eos_token_id"]
  # Each spelling alone gives the model: transformers 5 reads rope_parameters, 4 reads rope_theta and rope_scaling.
  v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
  v4 = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
  want = hf.llama_config(source)
  assert hf.llama_config(v5) == hf.llama_config(v4) == want
  # The float32 export reads back to the same logits, tensor for tensor the source's.
  exact = hf.save(model, tmp_path / "float32", source=source)
  tokens, theirs = reference(family)
  assert_close(logits(exact, tokens), theirs)
  original, written = load_file(FIXTURES / family / "model.safetensors"), load_file(exact / "model.safetensors")
  assert sorted(written) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(written[name], value)


def test_transformers4_reads_the_written_config(tmp_path):
  """transformers 4's config class reads what ``hf.save`` writes with the rotation it has (its own spelling), not its
  default base: the failure transformers 5's spelling alone meets there."""
  transformers = transformers4()
  saved = hf.save(hf.load(FIXTURES / "llama3"), tmp_path / "saved")
  config = transformers.AutoConfig.from_pretrained(saved)
  assert config.rope_theta == 5e5 and config.rope_scaling["factor"] == 8.0
  assert config.rope_scaling["original_max_position_embeddings"] == 256


def test_flax_layout_is_read(tmp_path):
  """Flax's names and layout (``...kernel`` as ``[in, out]``, ``embed_tokens.embedding``): those transformers 4's
  Flax models write; by hand for Qwen3 (no Flax model of it), by ``FlaxMistralForCausalLM.save_pretrained`` where
  transformers 4 is installed."""
  tensors = load_file(FIXTURES / "qwen3" / "model.safetensors")
  flax = {hf.flax_name(k): np.ascontiguousarray(v.T) if hf.flax_name(k).endswith(".kernel") else v
          for k, v in tensors.items()}  # fmt: skip
  assert "model.layers.0.self_attn.q_proj.kernel" in flax and "model.embed_tokens.embedding" in flax
  folder = tmp_path / "qwen3"
  folder.mkdir()
  save_file(flax, folder / "model.safetensors", metadata={"format": "flax"})
  shutil.copy(FIXTURES / "qwen3" / "config.json", folder)
  tokens, theirs = reference("qwen3")
  assert_close(logits(folder, tokens), theirs)
  del flax["model.norm.weight"]
  save_file(flax, folder / "model.safetensors", metadata={"format": "flax"})
  with pytest.raises(hf.CheckpointError, match=r"checkpoint \(Flax layout\) has no tensor model.norm.weight"):
    hf.load(folder)

  transformers = transformers4()
  pt = tmp_path / "mistral_pt"
  transformers.MistralConfig(**SPEC["families"]["mistral"]["v4"]).save_pretrained(pt)
  shutil.copy(FIXTURES / "mistral" / "model.safetensors", pt)
  model = transformers.FlaxMistralForCausalLM.from_pretrained(pt, from_pt=True)
  model.save_pretrained(tmp_path / "mistral_flax", safe_serialization=True)
  assert hf.layout(hf.weight_files(tmp_path / "mistral_flax")) == "flax"
  tokens, theirs = reference("mistral")
  assert_close(logits(tmp_path / "mistral_flax", tokens), theirs)
  (tmp_path / "mistral_flax" / "model.safetensors").rename(tmp_path / "mistral_flax" / "flax_model.msgpack")
  with pytest.raises(hf.CheckpointError, match=r"It holds flax_model.msgpack .*safe_serialization=True"):
    hf.load(tmp_path / "mistral_flax")


def test_rope_parameters_another_kind_or_disagreeing_with_rope_theta_are_refused():
  config = hf.read_config(FIXTURES / "llama3")
  yarn = {**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
  with pytest.raises(hf.CheckpointError, match="rope_scaling of type 'yarn'"):
    hf.llama_config(yarn)
  both = {**config, "rope_theta": 1e4}
  with pytest.raises(hf.CheckpointError, match="rope_theta=10000.0 and rope_parameters' rope_theta=500000.0 differ"):
    hf.llama_config(both)
  per_layer = {**config, "rope_parameters": {"full_attention": config["rope_parameters"],
                                             "sliding_attention": config["rope_parameters"]}}  # fmt: skip
  assert hf.llama_config(per_layer) == hf.llama_config(config)
