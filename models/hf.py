"""Hugging Face checkpoints in and out: the Llama family as ``models/llama.py``'s NNX model.

    model = hf.load("path/to/Qwen2.5-7B", dtype="bfloat16")   # an nnx Llama: model(tokens) -> logits
    hf.save(model, "out/", tokenizer_from="path/to/Qwen2.5-7B")  # config.json, safetensors shards, tokenizer files

A checkpoint folder holds ``config.json`` and ``model.safetensors``, or its
shards and ``model.safetensors.index.json``. The architectures read: Llama 2,
3 and 3.2 (``LlamaForCausalLM``, with Llama 3's ``rope_scaling`` where given,
tied embeddings where the config ties them), Mistral (``MistralForCausalLM``;
its sliding window becomes the model's ``block_size``, the longest sequence
it takes, within which a sliding window attends to every earlier token),
Qwen2/2.5 (``Qwen2ForCausalLM``: biases on q, k and v) and Qwen3
(``Qwen3ForCausalLM``: an RMSNorm on each head's q and k, ``head_dim`` apart
from ``hidden_size / heads``). :func:`llama_config` maps a config, in
transformers 4's spelling (``rope_theta``, ``rope_scaling``, ``torch_dtype``)
or 5's (``rope_parameters``, ``dtype``), onto :class:`models.llama.LlamaConfig`
and refuses, naming it, any field the model cannot express; :func:`hf_config`
writes one that both read.

Tensors are read one at a time from memory-mapped files (``safetensors``) and
placed straight into their parameter's sharding and memory (``shardings``),
cast to ``param_dtype`` there: the host never holds more than one tensor of
the model. Hugging Face stores a linear layer's weight as ``[out, in]``; the
NNX model's kernel is ``[in, out]`` (:data:`TRANSPOSED`). Flax-layout files
(transformers 4's Flax models: ``...kernel``, ``embed_tokens.embedding``) are
read too (:func:`layout`). Writing needs no accelerator: each tensor is
fetched to the host and transposed there (:func:`save_params`).
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
GENERATION = "generation_config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")  # fmt: skip
# Weights in other formats, which are not read: what saves them as safetensors.
OTHER_WEIGHTS = {
  "flax_model.msgpack": "Flax msgpack; FlaxLlamaForCausalLM.save_pretrained(DIR, safe_serialization=True)",
  "pytorch_model.bin": "a PyTorch pickle; LlamaForCausalLM.from_pretrained(DIR).save_pretrained(DIR)",
  "pytorch_model.bin.index.json": "PyTorch pickles; LlamaForCausalLM.from_pretrained(DIR).save_pretrained(DIR)",
}
SHARD_BYTES = 5 * 2**30  # a written shard's size at most, as transformers' save_pretrained's default

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
# The config fields known here: those llama_config reads, and those that do not change the model's function (ids,
# generation defaults, bookkeeping). Any other field that is set is refused by name.
KNOWN = {
  "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
  "pad_token_id", "initializer_range", "use_cache", "attention_dropout", "max_window_layers", "_name_or_path",
  "tokenizer_class", "pretraining_tp", "layer_types", "use_sliding_window", "sliding_window", "mlp_bias",
  "attention_bias", "rope_scaling", "rope_parameters", "hidden_act", "head_dim", "max_position_embeddings",
  "rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size", "hidden_size", "intermediate_size",
  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "bos_token", "eos_token", "output_attentions",
  "output_hidden_states", "return_dict", "is_decoder", "id2label", "label2id", "problem_type",
  "chunk_size_feed_forward", "is_encoder_decoder", "sep_token_id", "decoder_start_token_id", "torchscript",
}  # fmt: skip
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers 5's layer_types that models/llama.py computes


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


def rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
  """``(rope_theta, scaling)`` of a config in either spelling: transformers 5's ``rope_parameters`` (``rope_theta``
  and ``rope_type`` inside, with the scaling's fields), or transformers 4's ``rope_theta`` and ``rope_scaling``.
  ``scaling`` is ``None`` for the plain rotation (``rope_type`` ``"default"``), else the fields of Llama 3's
  (``rope_type`` ``"llama3"``); :class:`CheckpointError` for another kind, or where the two spellings disagree."""
  params = hf.get("rope_parameters")
  if params:
    if all(isinstance(v, dict) for v in params.values()):  # one per layer type: models/llama.py has one rotation
      kinds = {json.dumps(v, sort_keys=True) for v in params.values()}
      if len(kinds) > 1:
        raise CheckpointError(f"config.json: rope_parameters={params!r}: models/llama.py rotates every layer alike.")
      params = next(iter(params.values()))
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta") or 10000.0))
    if hf.get("rope_theta") is not None and float(hf["rope_theta"]) != theta:
      raise CheckpointError(
        f"config.json: rope_theta={hf['rope_theta']!r} and rope_parameters' rope_theta={theta!r} differ:"
        " transformers 4 reads the first, 5 the second; keep one."
      )
    scaling = params
  else:
    theta, scaling = float(hf.get("rope_theta") or 10000.0), dict(hf.get("rope_scaling") or {})
  kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise CheckpointError(
      f"config.json: rope_scaling of type {kind!r}: models/llama.py scales its rotary frequencies as Llama 3 does"
      " (rope_type 'llama3') only."
    )
  return theta, scaling


def llama_config(hf: dict[str, Any], **overrides: Any) -> llama.LlamaConfig:
  """The :class:`models.llama.LlamaConfig` of a Hugging Face config, in transformers 4's spelling or 5's
  (``overrides``: the run's fields, such as ``dtype``, ``param_dtype``, ``remat``, or a shorter ``block_size``);
  :class:`CheckpointError` naming the field the model cannot express."""
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
  layer_types = hf.get("layer_types") or []
  if any(t not in LAYER_TYPES for t in layer_types):
    refuse("layer_types", f"models/llama.py's layers are {' or '.join(LAYER_TYPES)}.")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or None
  if head_dim is None and d % heads:
    refuse("num_attention_heads", f"hidden_size {d} is not a whole number of heads, and head_dim is not given.")
  block = int(overrides.pop("block_size", None) or hf.get("max_position_embeddings", 2048))
  window = hf.get("sliding_window")
  sliding = "sliding_attention" in layer_types or (kind not in ("qwen2", "qwen3") or hf.get("use_sliding_window"))
  if window is not None and sliding:
    block = min(block, int(window))  # within its window, a sliding-window attention attends to the whole sequence
  theta, scaling = rope(hf)
  fields: dict[str, Any] = dict(
    vocab_size=hf["vocab_size"], block_size=block, n_layer=hf["num_hidden_layers"], n_head=heads,
    n_kv_head=hf.get("num_key_value_heads") or heads, d_model=d, ffn_dim=hf["intermediate_size"],
    rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=kind == "qwen2",
    qk_norm=kind == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    head_size=None if head_dim in (None, d // heads) and not d % heads else int(head_dim),
  )  # fmt: skip
  if scaling:
    fields.update(
      rope_scaling_factor=float(scaling["factor"]), rope_low_freq_factor=float(scaling["low_freq_factor"]),
      rope_high_freq_factor=float(scaling["high_freq_factor"]),
      rope_original_context=int(scaling["original_max_position_embeddings"]),
    )  # fmt: skip
  try:
    return llama.LlamaConfig(**{**fields, **overrides})
  except ValueError as e:
    raise CheckpointError(f"config.json: {e}") from None


# What a run may set apart from its checkpoint's config without changing the model's function.
RUN_FIELDS = ("dtype", "param_dtype", "remat", "block_size")


def hf_config(cfg: llama.LlamaConfig, source: dict[str, Any] | None = None, dtype: str | None = None) -> dict[str, Any]:
  """The Hugging Face ``config.json`` of a :class:`models.llama.LlamaConfig`, which transformers 4 and 5 both read:
  the rotation in both spellings (``rope_theta`` and ``rope_scaling``, and ``rope_parameters``), the dtype as
  ``torch_dtype`` and ``dtype`` (``dtype``: the tensors', default ``cfg.param_dtype``).

  ``source``: the config the model was read from (a fine-tune's); where it gives the same model (:func:`llama_config`
  of it equals ``cfg`` but for :data:`RUN_FIELDS`), its fields are kept (``model_type``, the token ids, the context
  length, a sliding window) and the model's written over them. Else the family is the one ``cfg`` implies: ``qwen3``
  with q/k norms, ``qwen2`` with q/k/v biases, else ``llama`` (a Mistral without a sliding window computes as a
  Llama)."""
  if cfg.qk_norm and cfg.qkv_bias:
    raise CheckpointError("a model with q/k norms and q/k/v biases has no Hugging Face family here (Qwen3's"
                          " attention_bias puts a bias on the output projection too).")  # fmt: skip
  kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
  dtype = dtype or cfg.param_dtype
  out: dict[str, Any] = {}
  if source is not None and _same_model(source, cfg):
    dropped = ("rope_scaling", "rope_parameters", "rope_theta", "transformers_version", "_name_or_path")
    out = {k: v for k, v in source.items() if k not in dropped}
    kind = source["model_type"]
    out.setdefault("architectures", [ARCHITECTURES[kind]])
  else:
    out.update(architectures=[ARCHITECTURES[kind]], model_type=kind, max_position_embeddings=cfg.block_size)
    if source is not None:
      out.update({k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source})
  out.update({
    "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden_dim,
    "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
    "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
    "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype, "dtype": dtype,
  })  # fmt: skip
  if kind in ("llama", "qwen3"):
    out.update(attention_bias=False)
  if kind == "llama":
    out.update(mlp_bias=False)
  rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling_factor is not None:
    out["rope_scaling"] = {
      "rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor, "original_max_position_embeddings": cfg.rope_original_context,
    }  # fmt: skip
    rope_parameters = {**out["rope_scaling"], "rope_theta": cfg.rope_theta}
  out["rope_parameters"] = rope_parameters
  return dict(sorted(out.items()))


def _same_model(source: dict[str, Any], cfg: llama.LlamaConfig) -> bool:
  """Whether the Hugging Face config ``source`` gives ``cfg``'s model, but for :data:`RUN_FIELDS`."""
  try:
    theirs = llama_config(source, **{k: getattr(cfg, k) for k in RUN_FIELDS})
  except (CheckpointError, KeyError, TypeError):
    return False
  return theirs == cfg


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
    if cfg.qk_norm:
      names += [(("blocks", i, "attn", f"{n}_norm", "norm", "scale"), f"{hf}self_attn.{n}_norm.weight") for n in "qk"]
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
    other = [name for name in OTHER_WEIGHTS if (folder / name).exists()]
    held = f" It holds {other[0]} ({OTHER_WEIGHTS[other[0]]}): save it as safetensors." if other else ""
    raise CheckpointError(f"{folder}: neither {WEIGHTS} nor {INDEX}; a Hugging Face checkpoint folder holds"
                          f" one.{held}")  # fmt: skip
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


def flax_name(name: str) -> str:
  """A tensor's name in the Flax layout (what transformers 4's ``FlaxLlamaForCausalLM.save_pretrained`` writes): a
  linear layer's ``weight`` is its ``kernel`` (``[in, out]``, not transposed), the token embedding's its
  ``embedding``; norms keep ``weight``."""
  if name == "model.embed_tokens.weight":
    return "model.embed_tokens.embedding"
  if name.endswith("_proj.weight") or name == "lm_head.weight":
    return name[: -len("weight")] + "kernel"
  return name


def layout(files: dict[str, Path]) -> str:
  """``"flax"`` where the checkpoint's tensors have Flax's names (``model.embed_tokens.embedding``, ``...kernel``),
  else ``"pt"`` (PyTorch's: what transformers' ``save_pretrained`` of a PyTorch model writes)."""
  flax = "model.embed_tokens.embedding" in files or any(name.endswith(".kernel") for name in files)
  return "flax" if flax else "pt"


def load_params(path: str | os.PathLike, cfg: llama.LlamaConfig, shardings: Any = None) -> dict:
  """The checkpoint's weights as ``cfg``'s model's parameter tree (``models.llama.abstract_params``' structure), each
  placed in its sharding (``shardings``: a tree like the parameters, or one sharding; default the first local
  device) and cast there to ``cfg.param_dtype``; read one tensor at a time. Either layout (:func:`layout`): PyTorch's
  weights are transposed on the way in, Flax's kernels are read as they are. :class:`CheckpointError` for a missing
  or extra tensor, or one of the wrong shape."""
  files = weight_files(path)
  abstract = llama.abstract_params(cfg)
  flax = layout(files) == "flax"
  names = [(ours, flax_name(theirs) if flax else theirs) for ours, theirs in tensor_names(cfg)]
  missing = [hf for _, hf in names if hf not in files]
  kind = " (Flax layout)" if flax else ""
  if missing:
    more = f" (nor {len(missing) - 1} others)" if len(missing) > 1 else ""
    raise CheckpointError(f"{path}: the checkpoint{kind} has no tensor {missing[0]}{more}, which its config.json's"
                          " model needs.")  # fmt: skip
  tied_copy = {"lm_head.kernel" if flax else "lm_head.weight"} if cfg.tie_embeddings else set()  # stored anyway
  extra = sorted(set(files) - {hf for _, hf in names} - tied_copy)
  if extra:
    more = f" (nor {len(extra) - 1} others)" if len(extra) > 1 else ""
    raise CheckpointError(f"{path}: tensor {extra[0]}{more}{kind} is not a parameter of models/llama.py's model for"
                          " this config.")  # fmt: skip
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  params = jax.tree.map(lambda _: None, abstract)
  where = dict((hf, ours) for ours, hf in names)
  for name, array in _tensors(files, [hf for _, hf in names]):
    ours = where[name]
    want = _get(abstract, ours)
    transpose = ours[-1] == TRANSPOSED and not flax
    if (array.shape[::-1] if transpose else array.shape) != want.shape:
      raise CheckpointError(
        f"{path}: tensor {name} has shape {list(array.shape)}; config.json's model needs"
        f" {list(want.shape[::-1] if transpose else want.shape)}."
      )
    sharding = shardings if isinstance(shardings, jax.sharding.Sharding) else _get(shardings, ours)
    _set(params, ours, _placed(array, sharding, want.dtype, transpose=transpose))
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


def save(model: Any, path: str | os.PathLike, tokenizer_from: str | os.PathLike | None = None,
         dtype: str | None = None, source: dict[str, Any] | None = None) -> Path:  # fmt: skip
  """Writes ``model`` (a :class:`models.llama.Llama`) as a Hugging Face checkpoint in ``path``
  (:func:`save_params`); returns ``path``."""
  return save_params(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), path, tokenizer_from, dtype, source)


def save_params(cfg: llama.LlamaConfig, params: Any, path: str | os.PathLike,
                tokenizer_from: str | os.PathLike | None = None, dtype: str | None = None,
                source: dict[str, Any] | None = None, generation: dict[str, Any] | None = None) -> Path:  # fmt: skip
  """Writes ``cfg``'s model with parameters ``params`` (``models.llama.abstract_params``' structure) in ``path``:
  ``config.json`` (:func:`hf_config`; ``source``: the config the model was read from, whose ids and family it
  keeps), safetensors shards of at most :data:`SHARD_BYTES` with their index (one ``model.safetensors`` where it
  fits) in ``dtype`` (default the parameters'), ``generation_config.json`` (``generation``, else the one of
  ``tokenizer_from``, else the ids of the config) and the tokenizer's files copied from ``tokenizer_from``.

  Each tensor is fetched to the host when its shard is written, cast and transposed there (:func:`host_array`): the
  accelerator is not used, so a save runs beside a training run that holds it. Returns ``path``."""
  from safetensors.numpy import save_file

  out = Path(path)
  out.mkdir(parents=True, exist_ok=True)
  names = tensor_names(cfg)
  dtype = dtype or _dtype_name(_get(params, names[0][0]).dtype)
  if dtype not in llama.DTYPES:
    raise ValueError(f"dtype {dtype!r}: a checkpoint is written in one of {llama.DTYPES}.")
  sizes = [math.prod(_get(params, ours).shape) * jnp.dtype(dtype).itemsize for ours, _ in names]
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
      tensors[hf] = host_array(_get(params, ours), dtype, transpose=ours[-1] == TRANSPOSED)
      weight_map[hf] = file
    save_file(tensors, out / file, metadata={"format": "pt"})
    del tensors
  if len(shards) > 1:
    total_size = sum(sizes)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
  config = hf_config(cfg, source, dtype)
  (out / CONFIG).write_text(json.dumps(config, indent=2))
  if tokenizer_from is not None:
    for name in TOKENIZER_FILES:
      if (Path(tokenizer_from) / name).exists():
        shutil.copy2(Path(tokenizer_from) / name, out / name)
  if generation is not None:
    (out / GENERATION).write_text(json.dumps(generation, indent=2))
  elif not (out / GENERATION).exists():
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    if ids:  # what transformers' save_pretrained writes from a model's config
      (out / GENERATION).write_text(json.dumps({"_from_model_config": True, **ids}, indent=2))
  return out


def _dtype_name(dtype: Any) -> str:
  return jnp.dtype(dtype).name


def host_array(x: Any, dtype: str, transpose: bool) -> np.ndarray:
  """``x`` (``.T`` where ``transpose``) in ``dtype`` as a C-contiguous host array: fetched as it is, then cast and
  transposed by numpy (what jax's CPU backend does more slowly), so the accelerator is never used."""
  value = np.asarray(jax.device_get(x))
  if value.dtype != jnp.dtype(dtype):
    value = value.astype(jnp.dtype(dtype))  # round to nearest even, as jax's astype
  return np.ascontiguousarray(value.T if transpose else value)
