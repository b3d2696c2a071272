"""Hugging Face checkpoints in and out: the Llama family as ``models/llama.py``'s NNX model.

    model = hf.load("path/to/Qwen2.5-7B", dtype="bfloat16")   # an nnx Llama: model(tokens) -> logits
    hf.save(model, "out/", tokenizer_from="path/to/Qwen2.5-7B")  # config.json, safetensors shards, tokenizer files

A checkpoint folder holds ``config.json`` and ``model.safetensors``, or its
shards and ``model.safetensors.index.json``. The architectures read: Llama 2
and 3 (``LlamaForCausalLM``, with Llama 3's ``rope_scaling`` where given),
Mistral (``MistralForCausalLM``; its sliding window becomes the model's
``block_size``, the longest sequence it takes, within which a sliding window
attends to every earlier token) and Qwen2/2.5 (``Qwen2ForCausalLM``: biases on q, k and v; tied
embeddings where the config ties them). :func:`llama_config` maps a config
onto :class:`models.llama.LlamaConfig` and refuses, naming it, any field the
model cannot express.

Tensors are read one at a time from memory-mapped files (``safetensors``) and
placed straight into their parameter's sharding and memory (``shardings``),
cast to ``param_dtype`` there: the host never holds more than one tensor of
the model. Hugging Face stores a linear layer's weight as ``[out, in]``; the
NNX model's kernel is ``[in, out]`` (:data:`TRANSPOSED`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import llama

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")  # fmt: skip
SHARD_BYTES = 5 * 2**30  # a written shard's size at most, as transformers' save_pretrained's default

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# The config fields known here: those llama_config reads, and those that do not change the model's function (ids,
# generation defaults, bookkeeping). Any other field that is set is refused by name.
KNOWN = {
  "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
  "pad_token_id", "initializer_range", "use_cache", "attention_dropout", "max_window_layers", "_name_or_path",
  "tokenizer_class", "pretraining_tp", "layer_types", "use_sliding_window", "sliding_window", "mlp_bias",
  "attention_bias", "rope_scaling", "hidden_act", "head_dim", "max_position_embeddings", "rms_norm_eps",
  "rope_theta", "tie_word_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
  "num_attention_heads", "num_key_value_heads", "bos_token", "eos_token", "output_attentions",
  "output_hidden_states", "return_dict", "is_decoder", "id2label", "label2id", "problem_type",
}  # fmt: skip


class CheckpointError(ValueError):
  """A checkpoint folder this module cannot read: the message names the file, tensor or config field."""


# ----------------------------------------------------------------------------- the config


def read_config(path: str | os.PathLike) -> dict[str, Any]:
  """The folder's ``config.json`` as a dict; :class:`CheckpointError` where it is missing or not JSON."""
  file = Path(path) / CONFIG
  try:
    return json.loads(file.read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{file}: no such file; a Hugging Face checkpoint folder holds config.json.") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{file}: not JSON ({e}).") from None


def llama_config(hf: dict[str, Any], **overrides: Any) -> llama.LlamaConfig:
  """The :class:`models.llama.LlamaConfig` of a Hugging Face config (``overrides``: the run's fields, such as
  ``dtype``, ``param_dtype``, ``remat``, or a shorter ``block_size``); :class:`CheckpointError` naming the field the
  model cannot express."""
  kind = hf.get("model_type")
  if kind not in ARCHITECTURES:
    raise CheckpointError(
      f"config.json: model_type {kind!r} (architectures {hf.get('architectures')}) is not one this reads; it reads"
      f" the Llama family: {', '.join(f'{k} ({v})' for k, v in ARCHITECTURES.items())}."
    )
  unknown = sorted(k for k, v in hf.items() if k not in KNOWN and v not in (None, False, {}, []))
  if unknown:
    raise CheckpointError(
      f"config.json: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not expressible by models/llama.py"
      f" (a {kind} model with {unknown[0]}={hf[unknown[0]]!r}); remove the field if it does not change the model."
    )

  def refuse(field: str, why: str):
    raise CheckpointError(f"config.json: {field}={hf.get(field)!r}: {why}")

  if hf.get("hidden_act", "silu") != "silu":
    refuse("hidden_act", "models/llama.py's MLP is SwiGLU (silu).")
  if hf.get("mlp_bias"):
    refuse("mlp_bias", "models/llama.py's MLP has no biases.")
  if hf.get("attention_bias"):
    refuse("attention_bias", "models/llama.py has no bias on the attention's output projection.")
  if hf.get("attention_dropout"):
    refuse("attention_dropout", "models/llama.py has no dropout; set it to 0.0 to fine-tune without it.")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  if hf.get("head_dim") not in (None, d // heads) or d % heads:
    refuse("head_dim", f"models/llama.py's heads are hidden_size / num_attention_heads = {d / heads:g} wide.")
  block = int(overrides.pop("block_size", None) or hf.get("max_position_embeddings", 2048))
  window = hf.get("sliding_window")
  if window is not None and (kind != "qwen2" or hf.get("use_sliding_window")):
    block = min(block, int(window))  # within its window, a sliding-window attention attends to the whole sequence
  fields: dict[str, Any] = dict(
    vocab_size=hf["vocab_size"], block_size=block, n_layer=hf["num_hidden_layers"], n_head=heads,
    n_kv_head=hf.get("num_key_value_heads") or heads, d_model=d, ffn_dim=hf["intermediate_size"],
    rope_theta=float(hf.get("rope_theta", 10000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    qkv_bias=kind == "qwen2", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )  # fmt: skip
  scaling = hf.get("rope_scaling")
  if scaling:
    kind_of = scaling.get("rope_type", scaling.get("type"))
    if kind_of != "llama3":
      raise CheckpointError(
        f"config.json: rope_scaling of type {kind_of!r}: models/llama.py scales its rotary frequencies as Llama 3"
        " does (rope_type 'llama3') only."
      )
    fields.update(
      rope_scaling_factor=float(scaling["factor"]), rope_low_freq_factor=float(scaling["low_freq_factor"]),
      rope_high_freq_factor=float(scaling["high_freq_factor"]),
      rope_original_context=int(scaling["original_max_position_embeddings"]),
    )  # fmt: skip
  try:
    return llama.LlamaConfig(**{**fields, **overrides})
  except ValueError as e:
    raise CheckpointError(f"config.json: {e}") from None


def hf_config(cfg: llama.LlamaConfig) -> dict[str, Any]:
  """The Hugging Face ``config.json`` of a :class:`models.llama.LlamaConfig`: ``qwen2`` where it has q/k/v biases,
  else ``llama`` (a Mistral without a sliding window computes as a Llama)."""
  kind = "qwen2" if cfg.qkv_bias else "llama"
  out = {
    "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layer,
    "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "hidden_act": "silu",
    "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
    "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.param_dtype,
  }  # fmt: skip
  if kind == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  if cfg.rope_scaling_factor is not None:
    out["rope_scaling"] = {
      "rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor, "original_max_position_embeddings": cfg.rope_original_context,
    }  # fmt: skip
  return out


# ----------------------------------------------------------------------------- the tensors' names

# NNX parameter path (within models/llama.py's tree) -> Hugging Face tensor name; a linear layer's kernel is the
# transpose of its Hugging Face weight.
TRANSPOSED = "kernel"


def tensor_names(cfg: llama.LlamaConfig) -> list[tuple[tuple[Any, ...], str]]:
  """Every parameter of ``cfg``'s model as ``(its path in the NNX parameter tree, its Hugging Face name)``."""
  names: list[tuple[tuple[Any, ...], str]] = [(("wte", "embedding"), "model.embed_tokens.weight")]
  for i in range(cfg.n_layer):
    hf = f"model.layers.{i}."
    names += [
      (("blocks", i, "attn_norm", "norm", "scale"), hf + "input_layernorm.weight"),
      (("blocks", i, "mlp_norm", "norm", "scale"), hf + "post_attention_layernorm.weight"),
    ]
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
      names.append((("blocks", i, "attn", ours, "kernel"), f"{hf}self_attn.{theirs}.weight"))
      if cfg.qkv_bias and ours != "wo":
        names.append((("blocks", i, "attn", ours, "bias"), f"{hf}self_attn.{theirs}.bias"))
    for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
      names.append((("blocks", i, "mlp", ours, "kernel"), f"{hf}mlp.{theirs}.weight"))
  names.append((("norm", "norm", "scale"), "model.norm.weight"))
  if not cfg.tie_embeddings:
    names.append((("head", "kernel"), "lm_head.weight"))
  return names


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: tuple[Any, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


# ----------------------------------------------------------------------------- reading


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
  """Each tensor's file: ``model.safetensors``'s, or the shards ``model.safetensors.index.json`` names (each must
  exist); :class:`CheckpointError` naming what is missing."""
  folder = Path(path)
  index = folder / INDEX
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map): {e}") from None
    files = {name: folder / file for name, file in weight_map.items()}
    missing = sorted({str(f) for f in files.values() if not f.exists()})
    if missing:
      raise CheckpointError(f"{index} names shards that are not there: {', '.join(missing)}.")
    return files
  single = folder / WEIGHTS
  if not single.exists():
    raise CheckpointError(f"{folder}: neither {WEIGHTS} nor {INDEX}; a Hugging Face checkpoint folder holds one.")
  from safetensors import safe_open

  with safe_open(single, framework="numpy") as f:
    return dict.fromkeys(f.keys(), single)


def _tensors(files: dict[str, Path], wanted: list[str]) -> Iterator[tuple[str, np.ndarray]]:
  """``(name, array)`` of every ``wanted`` tensor, one file open at a time, each file in its tensors' order."""
  from safetensors import safe_open

  by_file: dict[Path, list[str]] = {}
  for name in wanted:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with safe_open(file, framework="numpy") as f:
      for name in names:
        yield name, f.get_tensor(name)


def load_params(path: str | os.PathLike, cfg: llama.LlamaConfig, shardings: Any = None) -> dict:
  """The checkpoint's weights as ``cfg``'s model's parameter tree (``models.llama.abstract_params``' structure), each
  placed in its sharding (``shardings``: a tree like the parameters, or one sharding; default the first local
  device) and cast there to ``cfg.param_dtype``; read one tensor at a time. :class:`CheckpointError` for a missing
  or extra tensor, or one of the wrong shape."""
  files = weight_files(path)
  abstract = llama.abstract_params(cfg)
  names = tensor_names(cfg)
  missing = [hf for _, hf in names if hf not in files]
  if missing:
    more = f" (nor {len(missing) - 1} others)" if len(missing) > 1 else ""
    raise CheckpointError(f"{path}: the checkpoint has no tensor {missing[0]}{more}, which its config.json's model"
                          " needs.")  # fmt: skip
  tied_copy = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied checkpoints store the head anyway
  extra = sorted(set(files) - {hf for _, hf in names} - tied_copy)
  if extra:
    more = f" (nor {len(extra) - 1} others)" if len(extra) > 1 else ""
    raise CheckpointError(f"{path}: tensor {extra[0]}{more} is not a parameter of models/llama.py's model for this"
                          " config.")  # fmt: skip
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  params = jax.tree.map(lambda _: None, abstract)
  where = dict((hf, ours) for ours, hf in names)
  for name, array in _tensors(files, [hf for _, hf in names]):
    ours = where[name]
    want = _get(abstract, ours)
    if (array.shape[::-1] if ours[-1] == TRANSPOSED else array.shape) != want.shape:
      raise CheckpointError(
        f"{path}: tensor {name} has shape {list(array.shape)}; config.json's model needs"
        f" {list(want.shape[::-1] if ours[-1] == TRANSPOSED else want.shape)}."
      )
    sharding = shardings if isinstance(shardings, jax.sharding.Sharding) else _get(shardings, ours)
    _set(params, ours, _placed(array, sharding, want.dtype, transpose=ours[-1] == TRANSPOSED))
  return params


def _placed(value: np.ndarray, sharding: jax.sharding.Sharding, dtype: Any, transpose: bool) -> jax.Array:
  """``value`` (``.T`` where ``transpose``) in ``sharding``, each device given its shard from the host array, cast to
  ``dtype`` there. A transposed tensor goes over as stored, in the transposed sharding, and is transposed by the
  devices (a host transpose of a 7B model's matrices takes about a minute on one core); a sharding that cannot be
  transposed (neither one device's nor named) takes the host's copy."""
  flipped = _transposed(sharding) if transpose else sharding
  if flipped is None:
    value, transpose, flipped = np.ascontiguousarray(value.T), False, sharding
  x = jax.device_put(np.ascontiguousarray(value), flipped)
  return x if x.dtype == dtype and not transpose else _cast(jnp.dtype(dtype), sharding, transpose)(x)


def _transposed(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
  """The sharding of a matrix's transpose: one device's as it is, a named one with its two axes' specs swapped."""
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = (*sharding.spec, None, None)[:2]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[::-1]),
                                      memory_kind=sharding.memory_kind)  # fmt: skip
  return None


@functools.cache
def _cast(dtype: Any, sharding: jax.sharding.Sharding, transpose: bool) -> Callable[[jax.Array], jax.Array]:
  """``x -> x(.T).astype(dtype)`` into ``sharding``; the input is donated where it can be reused (no transpose)."""
  donate = () if transpose else (0,)
  return jax.jit(lambda x: (x.T if transpose else x).astype(dtype), out_shardings=sharding, donate_argnums=donate)


def load(path: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None, **overrides: Any) -> Any:
  """The checkpoint in ``path`` as a :class:`models.llama.Llama` (NNX): ``model(tokens) -> logits`` in float32,
  computing in ``dtype``, its parameters stored in ``param_dtype`` (default ``dtype``); ``overrides``: more
  :class:`models.llama.LlamaConfig` fields (``remat``, a shorter ``block_size``)."""
  cfg = llama_config(read_config(path), dtype=dtype, param_dtype=param_dtype or dtype, **overrides)
  return nnx.merge(llama.graphdef(cfg), load_params(path, cfg))


# ----------------------------------------------------------------------------- writing


def save(model: Any, path: str | os.PathLike, tokenizer_from: str | os.PathLike | None = None) -> Path:
  """Writes ``model`` (a :class:`models.llama.Llama`) as a Hugging Face checkpoint in ``path``
  (:func:`save_params`); returns ``path``."""
  return save_params(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), path, tokenizer_from)


def save_params(cfg: llama.LlamaConfig, params: Any, path: str | os.PathLike,
                tokenizer_from: str | os.PathLike | None = None) -> Path:  # fmt: skip
  """Writes ``cfg``'s model with parameters ``params`` (``models.llama.abstract_params``' structure) in ``path``:
  ``config.json``, safetensors shards of at most :data:`SHARD_BYTES` with their index (one ``model.safetensors``
  where it fits), in the parameters' dtype, and the tokenizer's files copied from ``tokenizer_from``. Each tensor is
  fetched to the host when its shard is written. Returns ``path``."""
  from safetensors.numpy import save_file

  out = Path(path)
  out.mkdir(parents=True, exist_ok=True)
  names = tensor_names(cfg)
  sizes = [math.prod(_get(params, ours).shape) * jnp.dtype(_get(params, ours).dtype).itemsize for ours, _ in names]
  shards, current, total = [], [], 0
  for (ours, hf), size in zip(names, sizes):
    if current and total + size > SHARD_BYTES:
      shards.append(current)
      current, total = [], 0
    current.append((ours, hf))
    total += size
  shards.append(current)
  weight_map = {}
  for k, shard in enumerate(shards):
    file = WEIGHTS if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    tensors = {}
    for ours, hf in shard:
      tensors[hf] = _fetched(_get(params, ours), transpose=ours[-1] == TRANSPOSED)
      weight_map[hf] = file
    save_file(tensors, out / file, metadata={"format": "pt"})
    del tensors
  if len(shards) > 1:
    total_size = sum(sizes)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
  (out / CONFIG).write_text(json.dumps(hf_config(cfg), indent=2))
  if tokenizer_from is not None:
    for name in TOKENIZER_FILES:
      if (Path(tokenizer_from) / name).exists():
        shutil.copy2(Path(tokenizer_from) / name, out / name)
  return out


def _fetched(x: Any, transpose: bool) -> np.ndarray:
  """``x`` (``.T`` where ``transpose``) as a C-contiguous host array: an accelerator's array is transposed there, before
  it is fetched; a host array (numpy, or in host memory) by numpy."""
  on_device = isinstance(x, jax.Array) and getattr(x.sharding, "memory_kind", None) in (None, "device")
  if transpose and on_device:
    x, transpose = _device_transpose(x), False
  value = np.asarray(jax.device_get(x))
  return np.ascontiguousarray(value.T if transpose else value)


@jax.jit
def _device_transpose(x: jax.Array) -> jax.Array:
  return x.T
