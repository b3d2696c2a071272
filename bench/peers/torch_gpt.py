"""``models/gpt.py``'s GPT in torch, shape for shape, for the peers (DeepSpeed, torchao) to train.

Same architecture and initialisation as the Flax model (GPT-2): token + learned position embeddings, ``n_layer``
pre-norm blocks ``x += attn(norm(x)); x += mlp(norm(x))``, a final norm and an output head tied to the token
embedding::

    logits = norm_f(x) @ wte.T                       (float32)

* attention is ``scaled_dot_product_attention(q, k, v, is_causal=True)`` (flash attention on a GPU in bf16);
* the MLP is ``Linear(d, 4d) -> GELU(tanh) -> Linear(4d, d)``;
* parameters are stored in ``cfg.param_dtype``, the residual stream and matmuls run in ``cfg.dtype`` (with float32
  parameters and a bf16 compute dtype, run the model under ``torch.autocast``); norms, logits and the loss are
  float32, the head outside autocast;
* ``remat=True`` recomputes each block in the backward pass (``torch.utils.checkpoint``, non-reentrant);
* N(0, 0.02) weights and embeddings, zero biases, unit norm scales, residual output projections scaled by
  ``1 / sqrt(2 n_layer)``.

Linear weights are ``[out, in]`` (torch's layout; Flax's kernels are ``[in, out]``): the parameter count is the same,
``host_memory.param_shapes(cfg)`` lists the shapes in ``named_parameters`` order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EPS = 1e-5


class Norm(nn.Module):
  """LayerNorm (with or without bias) or RMSNorm, computed in float32; returns ``out_dtype``."""

  def __init__(self, cfg: Any, dtype: torch.dtype, out_dtype: torch.dtype):
    super().__init__()
    self.kind, self.out_dtype = cfg.norm, out_dtype
    self.weight = nn.Parameter(torch.ones(cfg.d_model, dtype=dtype))
    with_bias = cfg.norm == "layernorm" and cfg.bias
    self.bias = nn.Parameter(torch.zeros(cfg.d_model, dtype=dtype)) if with_bias else None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x, w = x.float(), self.weight.float()
    if self.kind == "layernorm":
      y = F.layer_norm(x, w.shape, w, None if self.bias is None else self.bias.float(), EPS)
    else:
      y = F.rms_norm(x, w.shape, w, EPS)
    return y.to(self.out_dtype)


def _linear(cfg: Any, d_in: int, d_out: int, dtype: torch.dtype) -> nn.Linear:
  return nn.Linear(d_in, d_out, bias=cfg.bias, dtype=dtype)


class CausalSelfAttention(nn.Module):
  def __init__(self, cfg: Any, dtype: torch.dtype):
    super().__init__()
    self.n_head = cfg.n_head
    self.qkv = _linear(cfg, cfg.d_model, 3 * cfg.d_model, dtype)
    self.proj = _linear(cfg, cfg.d_model, cfg.d_model, dtype)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = (y.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for y in self.qkv(x).split(d, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, t, hd]
    return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
  def __init__(self, cfg: Any, dtype: torch.dtype):
    super().__init__()
    self.fc = _linear(cfg, cfg.d_model, 4 * cfg.d_model, dtype)
    self.proj = _linear(cfg, 4 * cfg.d_model, cfg.d_model, dtype)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
  def __init__(self, cfg: Any, dtype: torch.dtype, compute: torch.dtype):
    super().__init__()
    self.ln1 = Norm(cfg, dtype, compute)
    self.attn = CausalSelfAttention(cfg, dtype)
    self.ln2 = Norm(cfg, dtype, compute)
    self.mlp = MLP(cfg, dtype)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
  """``TorchGPT(cfg)(tokens[b, t]) -> float32 logits[b, t, vocab]``; ``(tokens, targets) -> mean cross-entropy``."""

  def __init__(self, cfg: Any):
    super().__init__()
    self.cfg = cfg
    dtype, self.compute = DTYPES[cfg.param_dtype], DTYPES[cfg.dtype]
    self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=dtype)
    self.wpe = nn.Embedding(cfg.block_size, cfg.d_model, dtype=dtype)
    self.blocks = nn.ModuleList(Block(cfg, dtype, self.compute) for _ in range(cfg.n_layer))
    self.ln_f = Norm(cfg, dtype, torch.float32)
    self.reset_parameters()

  @torch.no_grad()
  def reset_parameters(self) -> None:
    """GPT-2 initialisation, as ``models/gpt.py``."""
    residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
    for name, module in self.named_modules():
      if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=residual_std if name.endswith(".proj") else 0.02)
        if module.bias is not None:
          nn.init.zeros_(module.bias)
      elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)

  def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    _, t = tokens.shape
    if t > self.cfg.block_size:
      raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}.")
    x = (self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))[None]).to(self.compute)
    for block in self.blocks:
      if self.cfg.remat and torch.is_grad_enabled():
        x = checkpoint(block, x, use_reentrant=False)
      else:
        x = block(x)
    x = self.ln_f(x)
    with torch.autocast(x.device.type, enabled=False):  # the tied head and the loss in float32
      logits = x @ self.wte.weight.float().t()
      if targets is None:
        return logits
      return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
  """AdamW parameter groups as ``train.gpt.decay_mask``: decay on matrices and embeddings (``ndim >= 2``) only."""
  params = list(model.parameters())
  return [
    {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
  ]


def flax_leaf(model: nn.Module, name: str, params: dict) -> Any:
  """The ``models/gpt.py`` parameter (in ``nnx.to_pure_dict`` form) that torch parameter ``name`` mirrors.

  Linear weights are the transposed Flax kernels; embeddings are ``embedding``, norm weights ``norm.scale``.
  """
  *path, leaf = name.split(".")
  node = params
  for key in path:
    node = node[int(key)] if key.isdigit() else node[key]
  module = model.get_submodule(".".join(path))
  if isinstance(module, nn.Embedding):
    return node["embedding"]
  if isinstance(module, Norm):
    return node["norm"]["scale" if leaf == "weight" else "bias"]
  return node["kernel"].T if leaf == "weight" else node["bias"]


@torch.no_grad()
def load_flax(model: nn.Module, params: dict) -> None:
  """Copies ``models/gpt.py``'s parameters (``init_params``' dict of arrays) into ``model`` (same config)."""
  for name, p in model.named_parameters():
    p.copy_(torch.from_numpy(np.array(flax_leaf(model, name, params), dtype=np.float32)).to(p.dtype))


def count_params(model: nn.Module) -> int:
  """Parameters of ``model``, each tensor counted once (the tied head adds none)."""
  return sum(p.numel() for p in model.parameters())
