"""A Llama-style model in Flax NNX: RMSNorm, rotary positions, SwiGLU, grouped-query attention, an untied head.

Architecture (Llama 2): a token embedding, ``n_layer`` pre-norm blocks
``x += attn(rmsnorm(x)); x += mlp(rmsnorm(x))``, a final RMSNorm and an
output head of its own, or the token embedding's (``tie_embeddings``)::

    logits = rmsnorm(x) @ W_out                      (float32; W_out = W_emb^T when tied)

The same module holds the Llama family's checkpoints (Llama 2, 3 and 3.2,
Mistral, Qwen2/2.5 and Qwen3): ``models/hf.py`` reads and writes them.

* attention: ``n_head`` query heads and ``n_kv_head`` key/value heads
  (grouped-query attention; ``n_kv_head = n_head`` is multi-head), rotary
  position embeddings on queries and keys (the rotate-half form, base
  ``rope_theta``, with Llama 3's frequency scaling where ``rope_scaling_factor``
  is set: :func:`rope_frequencies`), ``jax.nn.dot_product_attention(is_causal=True)``
  (``lm.attention``: within a segment only, for packed rows);
  biases on the query, key and value projections with ``qkv_bias`` (Qwen2's),
  none elsewhere; with ``qk_norm`` (Qwen3's) an RMSNorm over each head's
  query and key before the rotation; each head ``head_size`` wide where set
  (Qwen3's ``head_dim``, apart from ``d_model / n_head``);
* the MLP is SwiGLU: ``W_down(silu(W_gate x) * W_up x)``, its width
  ``ffn_dim`` (default: ``8d/3`` rounded up to a multiple of ``multiple_of``,
  Llama's rule: 11008 at ``d = 4096``);
* ``param_dtype`` (storage) and ``dtype`` (compute) are separate; norms,
  logits and the loss are computed in float32; ``remat`` is each block's
  rematerialisation policy, as the GPT's (``jax_dos.staged.remat``: ``"none"``,
  ``"minimal"``, ``"full"``, ``"offload"``; ``True``/``False`` mean
  ``"full"``/``"none"``).

The large matmuls' outputs are named for rematerialisation policies
(``jax.ad_checkpoint.checkpoint_name``): ``"qkv_proj"`` (the q, k and v
projections), ``"out_proj"`` (attention's output projection), ``"mlp_in"``
(the gate and up projections) and ``"mlp_out"`` (the down projection).

Initialisation: N(0, 0.02) weights, the residual output projections
(``wo``, ``w_down``) scaled by ``1 / sqrt(2 n_layer)``, norms at one.

The module-level interface is ``models/gpt.py``'s (``get_config``,
``init_params``, ``abstract_params``, ``param_count``, ``flops_per_token``,
``staged``), so ``python -m train.gpt --arch llama`` trains it as it trains
the GPT.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jax_dos
from models import lm
from models.lm import DTYPES, cross_entropy, loss, make_loss_fn, tree_size

__all__ = ["DTYPES", "Llama", "LlamaConfig", "PRESETS", "abstract_params", "cross_entropy", "flops_per_token",
           "get_config", "graphdef", "init_params", "loss", "make_loss_fn", "param_count", "staged",
           "tree_size"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model hyperparameters. Dtypes are names (``"float32"``/``"bfloat16"``) so the config is JSON-able."""

  vocab_size: int = 256  # 256 = bytes (the default data); Llama 2's tokenizer: 32000
  block_size: int = 128  # the longest sequence trained on (rotary positions need no table)
  n_layer: int = 4
  n_head: int = 4
  n_kv_head: int = 2  # key/value heads; n_head must be a multiple
  d_model: int = 128
  ffn_dim: int | None = None  # SwiGLU width; None: 8 d / 3 rounded up to a multiple of multiple_of
  multiple_of: int = 256
  rope_theta: float = 10000.0
  # Llama 3's rotary frequency scaling (rope_scaling {"rope_type": "llama3", ...} in a Hugging Face config): off at None
  rope_scaling_factor: float | None = None
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_context: int = 8192  # original_max_position_embeddings
  qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
  qk_norm: bool = False  # an RMSNorm over each head's q and k, before the rotation (Qwen3)
  head_size: int | None = None  # each attention head's width; None: d_model / n_head (Qwen3 sets its own)
  tie_embeddings: bool = False  # the head is the token embedding's transpose
  norm_eps: float = 1e-5
  dtype: str = "float32"  # compute dtype of matmuls and the residual stream
  param_dtype: str = "float32"  # storage dtype of the parameters
  remat: str = "none"  # each block's rematerialisation policy: none, minimal, full or offload (True: full)

  def __post_init__(self):
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "d_model", "multiple_of"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}.")
    if self.head_size is not None and (not isinstance(self.head_size, int) or self.head_size < 2 or self.head_size % 2):
      raise ValueError(f"LlamaConfig.head_size must be None or an even positive integer, got {self.head_size!r}.")
    if self.head_size is None and (self.d_model % self.n_head or (self.d_model // self.n_head) % 2):
      raise ValueError(
        f"d_model={self.d_model} must be n_head={self.n_head} heads of an even width (rotary embeddings rotate pairs)."
      )
    if self.n_head % self.n_kv_head:
      raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}.")
    if self.rope_scaling_factor is not None and not (
      self.rope_scaling_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
      and self.rope_original_context >= 1
    ):  # fmt: skip
      raise ValueError(
        f"Llama 3 rope scaling needs factor >= 1 and 0 < low_freq_factor < high_freq_factor, got factor"
        f" {self.rope_scaling_factor}, low {self.rope_low_freq_factor}, high {self.rope_high_freq_factor}."
      )
    if self.ffn_dim is not None and (not isinstance(self.ffn_dim, int) or self.ffn_dim < 1):
      raise ValueError(f"LlamaConfig.ffn_dim must be a positive integer or None, got {self.ffn_dim!r}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"LlamaConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}.")
    if isinstance(self.remat, bool):
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in jax_dos.REMAT_POLICIES:
      raise ValueError(f"LlamaConfig.remat must be one of {jax_dos.REMAT_POLICIES}, got {self.remat!r}.")

  @property
  def head_dim(self) -> int:
    """Each attention head's width: ``head_size``, or ``d_model / n_head``."""
    return self.head_size if self.head_size is not None else self.d_model // self.n_head

  @property
  def hidden_dim(self) -> int:
    """The SwiGLU width: ``ffn_dim``, or ``8 d / 3`` rounded up to a multiple of ``multiple_of``."""
    if self.ffn_dim is not None:
      return self.ffn_dim
    return self.multiple_of * -(-(8 * self.d_model // 3) // self.multiple_of)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# Named sizes. A preset without vocab_size takes the data's (256 for bytes); the large ones are Llama's own shapes
# with its 32000-token vocabulary: TinyLlama's 1.1B and Llama 2's 7B.
PRESETS: dict[str, dict[str, Any]] = {
  "tiny": dict(n_layer=4, n_head=4, n_kv_head=2, d_model=128, block_size=128, multiple_of=32),  # ~0.8M params
  "small": dict(n_layer=6, n_head=6, n_kv_head=2, d_model=384, block_size=256, multiple_of=32),
  "llama-1.1b": dict(n_layer=22, n_head=32, n_kv_head=4, d_model=2048, block_size=2048, vocab_size=32000),
  "llama-7b": dict(n_layer=32, n_head=32, n_kv_head=32, d_model=4096, block_size=4096, vocab_size=32000),
}


def get_config(preset: str, **overrides: Any) -> LlamaConfig:
  """The :class:`LlamaConfig` of a named preset, with fields overridden (e.g. ``vocab_size=256``)."""
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
  return LlamaConfig(**{**PRESETS[preset], **overrides})


# ----------------------------------------------------------------------------- the model


def _linear(cfg: LlamaConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
  return nnx.Linear(
      d_in, d_out, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      kernel_init=nnx.initializers.normal(std), bias_init=nnx.initializers.zeros, rngs=rngs,
  )  # fmt: skip


class RMSNorm(nnx.Module):
  """RMSNorm (over the last axis, ``dim`` wide: default ``d_model``) computed in float32; returns the compute dtype
  (or ``out_dtype``)."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, dim: int | None = None):
    self.norm = nnx.RMSNorm(dim or cfg.d_model, epsilon=cfg.norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                            rngs=rngs)  # fmt: skip
    self.out_dtype = cfg.dtype

  def __call__(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
    return self.norm(x.astype(jnp.float32)).astype(out_dtype or self.out_dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
  r"""The rotary angular frequencies :math:`\theta^{-2i/hd}`, ``i < hd/2``, in float32; with ``scaling =
  (factor, low_freq_factor, high_freq_factor, original_context)``, Llama 3's: a frequency whose wavelength
  :math:`\lambda = 2\pi / f` exceeds ``original_context / low_freq_factor`` is divided by ``factor``, one whose
  wavelength is under ``original_context / high_freq_factor`` is kept, and between them
  :math:`f' = (1 - s) f / \mathrm{factor} + s f`, :math:`s = (\mathrm{original}/\lambda - \mathrm{low}) /
  (\mathrm{high} - \mathrm{low})`."""
  freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return freq
  factor, low, high, original = scaling
  wavelength = 2 * math.pi / freq
  smooth = (original / wavelength - low) / (high - low)
  between = (1 - smooth) * freq / factor + smooth * freq
  return jnp.where(wavelength > original / low, freq / factor, jnp.where(wavelength < original / high, freq, between))


def rotary(x: jax.Array, freq: jax.Array, positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding of ``x[b, t, heads, hd]`` at positions ``0 .. t-1``, or ``positions[b, t]``
  (packed rows': each from 0 in its row), rotate-half form, in float32.

  Channel pairs ``(i, i + hd/2)`` turn by the angle ``pos * freq[i]`` (:func:`rope_frequencies`).
  """
  if positions is None:
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq[None, :]  # [t, hd/2]
    cos, sin = (f(angle)[None, :, None, :] for f in (jnp.cos, jnp.sin))
  else:
    angle = positions.astype(jnp.float32)[..., None] * freq  # [b, t, hd/2]
    cos, sin = (f(angle)[:, :, None, :] for f in (jnp.cos, jnp.sin))
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.n_head, self.n_kv_head, self.head_dim, self.theta = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_theta
    self.rope_scaling = None if cfg.rope_scaling_factor is None else (
      cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_context
    )  # fmt: skip
    q_width, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    self.wq = _linear(cfg, cfg.d_model, q_width, 0.02, rngs, cfg.qkv_bias)
    self.wk = _linear(cfg, cfg.d_model, kv, 0.02, rngs, cfg.qkv_bias)
    self.wv = _linear(cfg, cfg.d_model, kv, 0.02, rngs, cfg.qkv_bias)
    self.wo = _linear(cfg, q_width, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)
    self.qk_norm = cfg.qk_norm
    if cfg.qk_norm:
      self.q_norm, self.k_norm = RMSNorm(cfg, rngs, cfg.head_dim), RMSNorm(cfg, rngs, cfg.head_dim)

  def __call__(self, x: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    b, t, _ = x.shape
    q = checkpoint_name(self.wq(x), "qkv_proj").reshape(b, t, self.n_head, self.head_dim)
    k = checkpoint_name(self.wk(x), "qkv_proj").reshape(b, t, self.n_kv_head, self.head_dim)
    v = checkpoint_name(self.wv(x), "qkv_proj").reshape(b, t, self.n_kv_head, self.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    freq = rope_frequencies(self.head_dim, self.theta, self.rope_scaling)
    q, k = rotary(q, freq, positions), rotary(k, freq, positions)
    y = lm.attention(q, k, v, segments)  # [b, t, h, hd]
    return checkpoint_name(self.wo(y.reshape(b, t, self.n_head * self.head_dim)), "out_proj")


class SwiGLU(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    f = cfg.hidden_dim
    self.w_gate = _linear(cfg, cfg.d_model, f, 0.02, rngs)
    self.w_up = _linear(cfg, cfg.d_model, f, 0.02, rngs)
    self.w_down = _linear(cfg, f, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate, up = checkpoint_name(self.w_gate(x), "mlp_in"), checkpoint_name(self.w_up(x), "mlp_in")
    return checkpoint_name(self.w_down(jax.nn.silu(gate) * up), "mlp_out")


class Block(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg, rngs)
    self.mlp = SwiGLU(cfg, rngs)

  def __call__(self, x: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    x = x + self.attn(self.attn_norm(x), segments, positions)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """``Llama(config, rngs)(tokens[b, t]) -> logits[b, t, vocab]`` in float32."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         embedding_init=nnx.initializers.normal(0.02), rngs=rngs)  # fmt: skip
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
    self.norm = RMSNorm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.head = _linear(cfg, cfg.d_model, cfg.vocab_size, 0.02, rngs)

  def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """The token embedding: the residual stream ``x[b, t, d]`` the blocks take (``positions`` rotate queries and
    keys in the blocks; read here for the interface's sake, as ``models.gpt.GPT.embed``'s)."""
    if tokens.shape[1] > self.cfg.block_size:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds block_size {self.cfg.block_size}.")
    return self.wte(tokens)

  def logits(self, x: jax.Array) -> jax.Array:
    """The final norm and the output head (the token embedding's transpose where tied): float32 logits."""
    x = self.norm(x, out_dtype=jnp.float32)
    if self.cfg.tie_embeddings:
      return x @ self.wte.embedding[...].astype(jnp.float32).T
    return x @ self.head.kernel[...].astype(jnp.float32)

  def __call__(self, tokens: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None):
    """Logits of ``tokens``; of packed rows with their ``segments`` and ``positions`` (``train.data.pack``), each
    row's as if alone."""
    rows = () if segments is None else (segments, positions)
    return self.logits(lm.run_blocks(self.blocks, self.embed(tokens), self.cfg.remat, *rows))


# ----------------------------------------------------------------------------- parameters, counts, stages


def init_params(cfg: LlamaConfig, seed: int = 0, shardings: Any = None) -> tuple[nnx.GraphDef, dict]:
  """Builds the model; returns ``(graphdef, params)`` with ``params`` a plain nested dict of arrays.

  Two jitted programs (``lm.init_by_block``); ``shardings``, and the parameters committed without it, as
  ``models.gpt.init_params``'.
  """
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return graphdef(cfg), lm.init_by_block(Llama, Block, cfg, np.uint32(seed), shardings)


def graphdef(cfg: LlamaConfig) -> nnx.GraphDef:
  """The model's static graph (``nnx.split``'s first half), made from shapes: parameters merge into it
  (``nnx.merge(graphdef(cfg), params)``)."""
  return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]


def abstract_params(cfg: LlamaConfig) -> dict:
  """The parameter tree as ``jax.ShapeDtypeStruct`` s, built with ``nnx.eval_shape`` (allocates nothing; one block
  traced, ``lm.abstract_by_block``)."""
  return lm.abstract_by_block(Llama, cfg)


def param_count(cfg: LlamaConfig) -> int:
  r"""Parameters of the model, from the config alone.

  .. math:: N = e V d + L (2 d d_q + 2 d d_{kv} + 3 d f + 2 d + b + n) + d

  with ``d_q = n_head * head_dim`` (``d`` unless ``head_size`` is set), ``d_kv = n_kv_head * head_dim``, ``f`` the
  SwiGLU width, ``e = 1`` with tied embeddings (else 2), ``b = d_q + 2 d_kv`` with ``qkv_bias`` (else 0) and
  ``n = 2 head_dim`` with ``qk_norm`` (else 0): 6.74B for Llama 2 7B's shape.
  """
  d, f, q, kv = cfg.d_model, cfg.hidden_dim, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
  biases = q + 2 * kv if cfg.qkv_bias else 0
  norms = 2 * cfg.head_dim if cfg.qk_norm else 0
  embeddings = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * d
  return embeddings + cfg.n_layer * (2 * d * q + 2 * d * kv + 3 * d * f + 2 * d + biases + norms) + d


def flops_per_token(cfg: LlamaConfig, seq_len: int | None = None) -> int:
  r"""Training FLOPs per token (forward + backward), as ``models.gpt.flops_per_token``: :math:`6 N + 12 L d_q T`
  (``d_q = n_head * head_dim``, the attention's width: ``d`` unless ``head_size`` is set).

  ``N`` excludes the token embedding (a lookup; the untied head is a matmul
  and counts, and a tied head counts the embedding once). Rematerialisation's extra forward pass is not counted.
  """
  t = cfg.block_size if seq_len is None else seq_len
  lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
  return 6 * (param_count(cfg) - lookup) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * t


def staged(cfg: LlamaConfig, rows: bool = False) -> jax_dos.NNXStages:
  """The model as ``jax_dos.OverlappedStep``'s stages (``jax_dos.nnx_stages``), from its own modules; with
  ``rows``, of packed rows' batches (``lm.staged``).

  Groups ``[token embedding, block 0, ..., block L-1, final norm and head]``; a tied head's stage uses the token
  embedding's group too.
  """
  return lm.staged(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), cfg.block_size, rows)
