"""A GPT in Flax NNX, nanoGPT style: one file, config at the top.

Architecture (GPT-2): token + learned position embeddings, ``n_layer`` pre-norm
blocks ``x += attn(norm(x)); x += mlp(norm(x))``, a final norm and an output
head tied to the token embedding::

    logits = norm_f(x) @ wte.T                       (float32)

* attention is ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``
  (``lm.attention``: within a segment only, for packed rows), asking for
  cuDNN's fused kernel on a GPU in bfloat16 (jax's default is the XLA
  implementation, which materialises the T x T scores) and XLA elsewhere;
* the MLP is ``Linear(d, 4d) -> GELU(tanh) -> Linear(4d, d)``;
* ``param_dtype`` (storage) and ``dtype`` (compute) are separate; norms,
  logits and the loss are always computed in float32;
* ``remat`` is each block's rematerialisation policy (``jax_dos.staged.remat``):
  ``"none"`` keeps every activation for the backward pass, ``"full"``
  recomputes the block (``nnx.remat``), ``"minimal"`` keeps the outputs of
  the large matmuls, tagged ``qkv_proj``, ``out_proj``, ``mlp_in`` and
  ``mlp_out`` (``jax.ad_checkpoint.checkpoint_name``), and recomputes the
  rest; ``"offload"`` keeps those in host memory. ``True``/``False`` mean
  ``"full"``/``"none"``.

Initialisation as GPT-2: N(0, 0.02) weights, zero biases, and residual output
projections scaled by ``1 / sqrt(2 n_layer)``.

For a jitted gradient step, split the model into a static graph and a plain
dict of parameter arrays and use the pure loss::

    graphdef, params = init_params(config, seed=0)
    loss_fn = make_loss_fn(graphdef)        # (params, (x, y)) -> mean cross-entropy, fp32
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, (x, y))

:func:`param_count` and :func:`flops_per_token` compute from the config alone;
:func:`abstract_params` builds the parameter tree with ``nnx.eval_shape`` (no
memory), so even the largest preset can be inspected on a laptop.
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

__all__ = ["DTYPES", "GPT", "GPTConfig", "PRESETS", "abstract_params", "cross_entropy", "flops_per_token",
           "get_config", "init_params", "loss", "make_loss_fn", "param_count", "staged", "tree_size"]  # fmt: skip

NORMS = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model hyperparameters. Dtypes are names (``"float32"``/``"bfloat16"``) so the config is JSON-able."""

  vocab_size: int = 256  # 256 = bytes (the default data); 50304 for GPT-2 BPE padded to a multiple of 64
  block_size: int = 128  # maximum sequence length (size of the position embedding)
  n_layer: int = 4
  n_head: int = 4
  d_model: int = 128
  bias: bool = True  # biases in Linear layers and LayerNorms (GPT-2: True)
  norm: str = "layernorm"  # or "rmsnorm"
  dtype: str = "float32"  # compute dtype of matmuls and the residual stream
  param_dtype: str = "float32"  # storage dtype of the parameters
  remat: str = "none"  # each block's rematerialisation policy: none, minimal, full or offload (True: full)

  def __post_init__(self):
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
    if self.d_model % self.n_head:
      raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}.")
    if self.norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"GPTConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}.")
    if isinstance(self.remat, bool):
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in jax_dos.REMAT_POLICIES:
      raise ValueError(f"GPTConfig.remat must be one of {jax_dos.REMAT_POLICIES}, got {self.remat!r}.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_head

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# Named sizes. gpt-1.3b is GPT-3 XL's shape (d2048 L24 H16, 1.3B with a 50k vocabulary), not GPT-2 XL (1.5B).
PRESETS: dict[str, dict[str, int]] = {
  "tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=128),  # ~0.8M params: trains on a laptop CPU in minutes
  "small": dict(n_layer=6, n_head=6, d_model=384, block_size=256),  # nanoGPT's shakespeare-char size
  "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, block_size=1024),
  "gpt2-350m": dict(n_layer=24, n_head=16, d_model=1024, block_size=1024),
  "gpt-1.3b": dict(n_layer=24, n_head=16, d_model=2048, block_size=2048),
  "gpt-2.7b": dict(n_layer=32, n_head=32, d_model=2560, block_size=2048),
  "gpt-6.7b": dict(n_layer=32, n_head=32, d_model=4096, block_size=2048),
  "gpt-13b": dict(n_layer=40, n_head=40, d_model=5120, block_size=2048),  # GPT-3 13B's shape
  "gpt-30b": dict(n_layer=48, n_head=56, d_model=7168, block_size=2048),  # 30.0B: OPT-30B's shape
}


def get_config(preset: str, **overrides: Any) -> GPTConfig:
  """The :class:`GPTConfig` of a named preset, with fields overridden (e.g. ``vocab_size=50304``)."""
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
  return GPTConfig(**{**PRESETS[preset], **overrides})


# ----------------------------------------------------------------------------- the model


def _linear(cfg: GPTConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
      d_in, d_out, use_bias=cfg.bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      kernel_init=nnx.initializers.normal(std), bias_init=nnx.initializers.zeros, rngs=rngs,
  )  # fmt: skip


class Norm(nnx.Module):
  """LayerNorm or RMSNorm computed in float32; returns the compute dtype."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    kw = dict(epsilon=1e-5, dtype=jnp.float32, param_dtype=cfg.param_dtype, rngs=rngs)
    self.out_dtype = cfg.dtype
    if cfg.norm == "layernorm":
      self.norm = nnx.LayerNorm(cfg.d_model, use_bias=cfg.bias, **kw)
    else:
      self.norm = nnx.RMSNorm(cfg.d_model, **kw)

  def __call__(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
    return self.norm(x.astype(jnp.float32)).astype(out_dtype or self.out_dtype)


class CausalSelfAttention(nnx.Module):
  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.n_head = cfg.n_head
    self.qkv = _linear(cfg, cfg.d_model, 3 * cfg.d_model, 0.02, rngs)
    self.proj = _linear(cfg, cfg.d_model, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)

  def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    b, t, d = x.shape
    qkv = checkpoint_name(self.qkv(x), "qkv_proj")
    q, k, v = (y.reshape(b, t, self.n_head, d // self.n_head) for y in jnp.split(qkv, 3, axis=-1))
    y = lm.attention(q, k, v, segments)  # [b, t, h, hd]
    return checkpoint_name(self.proj(y.reshape(b, t, d)), "out_proj")


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.fc = _linear(cfg, cfg.d_model, 4 * cfg.d_model, 0.02, rngs)
    self.proj = _linear(cfg, 4 * cfg.d_model, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = checkpoint_name(self.fc(x), "mlp_in")
    return checkpoint_name(self.proj(jax.nn.gelu(h, approximate=True)), "mlp_out")


class Block(nnx.Module):
  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.ln1 = Norm(cfg, rngs)
    self.attn = CausalSelfAttention(cfg, rngs)
    self.ln2 = Norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """``positions`` (packed rows') are the embedding's (:meth:`GPT.embed`); read here for the interface's sake."""
    x = x + self.attn(self.ln1(x), segments)
    return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
  """``GPT(config, rngs)(tokens[b, t]) -> logits[b, t, vocab]`` in float32."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    emb = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, **emb)
    self.wpe = nnx.Embed(cfg.block_size, cfg.d_model, **emb)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
    self.ln_f = Norm(cfg, rngs)

  def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Token plus position embeddings: the residual stream ``x[b, t, d]`` the blocks take; the positions ``0 ..
    t-1``, or ``positions[b, t]`` (packed rows': each from 0 in its row, below ``block_size``)."""
    _, t = tokens.shape
    if t > self.cfg.block_size:
      raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}.")
    if positions is not None:
      return self.wte(tokens) + self.wpe(positions)
    return self.wte(tokens) + self.wpe(jnp.arange(t))[None]

  def logits(self, x: jax.Array) -> jax.Array:
    """The final norm and the head tied to the token embedding: float32 logits."""
    x = self.ln_f(x, out_dtype=jnp.float32)
    return x @ self.wte.embedding[...].astype(jnp.float32).T

  def __call__(self, tokens: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None):
    """Logits of ``tokens``; of packed rows with their ``segments`` and ``positions`` (``train.data.pack``), each
    row's as if alone."""
    x = self.embed(tokens, positions)
    rows = () if segments is None else (segments, positions)
    return self.logits(lm.run_blocks(self.blocks, x, self.cfg.remat, *rows))


# ----------------------------------------------------------------------------- parameters, loss


def init_params(cfg: GPTConfig, seed: int = 0, shardings: Any = None) -> tuple[nnx.GraphDef, dict]:
  """Builds the model; returns ``(graphdef, params)`` with ``params`` a plain nested dict of arrays.

  Initialisation is two jitted programs, one for every block and one for the rest (``lm.init_by_block``), not
  one dispatch per initializer nor one program with every layer in it.
  ``shardings`` (a tree like :func:`abstract_params`, or one sharding) lays the parameters out on a mesh as they
  are made: each device computes its own shards, the same values as unsharded. Without it they are committed to
  the first local device, where an update leaves them: a training step's first call compiles the programs of
  every later one.
  """
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return graphdef, lm.init_by_block(GPT, Block, cfg, np.uint32(seed), shardings)


def abstract_params(cfg: GPTConfig) -> dict:
  """The parameter tree as ``jax.ShapeDtypeStruct`` s, built with ``nnx.eval_shape`` (allocates nothing; one block
  traced, ``lm.abstract_by_block``)."""
  return lm.abstract_by_block(GPT, cfg)


def param_count(cfg: GPTConfig) -> int:
  r"""Parameters of the model, from the config alone.

  .. math:: N = V d + T d + L (12 d^2 + b_l + 2 n_l) + n_l

  with ``b_l = 9d`` biases per block (``0`` without bias) and ``n_l`` the
  parameters of one norm (``2d`` for LayerNorm with bias, ``d`` otherwise).
  """
  d, n_layer = cfg.d_model, cfg.n_layer
  norm = 2 * d if (cfg.norm == "layernorm" and cfg.bias) else d
  biases = 9 * d if cfg.bias else 0
  return cfg.vocab_size * d + cfg.block_size * d + n_layer * (12 * d * d + biases + 2 * norm) + norm


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
  r"""Training FLOPs per token (forward + backward), as in nanoGPT / PaLM (appendix B).

  .. math:: 6 N + 12 L d T

  where ``N`` excludes the position embedding (a lookup, no matmul; the token
  embedding counts because the tied head multiplies by it) and ``T`` is the
  sequence length (default ``block_size``). Rematerialisation's extra forward
  pass is not counted: MFU measures useful work.
  """
  t = cfg.block_size if seq_len is None else seq_len
  n = param_count(cfg) - cfg.block_size * cfg.d_model
  return 6 * n + 12 * cfg.n_layer * cfg.d_model * t


# ----------------------------------------------------------------------------- stages, for jax_dos.OverlappedStep


def staged(cfg: GPTConfig, rows: bool = False) -> jax_dos.NNXStages:
  """The model as ``jax_dos.OverlappedStep``'s stages (``jax_dos.nnx_stages``), from its own modules; with
  ``rows``, of packed rows' batches (``lm.staged``).

  Groups ``[embeddings (wte, wpe), block 0, ..., block L-1, final norm]``;
  the head's stage uses the embeddings' group too (tied weights).
  ``staged(cfg).split(params)`` and ``.merge(groups)`` convert between
  :func:`init_params`' dict and the groups.
  """
  return lm.staged(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), cfg.block_size, rows)
