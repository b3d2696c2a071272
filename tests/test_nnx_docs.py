"""docs/api.md's "Flax NNX" examples run, in order, and each update they take is optax's.

The first block defines the model, loss and batch; the test then gives it fresh random parameters and data. The
next three take one step each from a fresh optimizer (``tx``): the model after it must be one ``optax.adamw`` step
(``tx``'s hyperparameters) from the model before it, on the gradients of the same loss. The last two (the adapter,
``jax_dos.nnx_stages``) define a staged model and train it with ``OverlappedStep``: three steps of
``optax.chain(clip_by_global_norm, adamw)`` on the mean gradient of the batch's two halves.
"""

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import max_rel_diff

import jax_dos

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def section_blocks(title: str = "Flax NNX") -> list[str]:
  text = API.read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return re.findall(r"```python\n(.*?)```", text[start : end if end >= 0 else None], re.S)


def copy_of(model):
  """A model with copies of ``model``'s arrays (``nnx.clone`` shares them, and an eager update may consume them)."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def params_of(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def optax_step(model, namespace) -> dict:
  """The parameters one optax.adamw step (the block's ``tx``'s hyperparameters) takes ``model`` to."""
  h = namespace["tx"].interleaved.hyper
  ref = optax.adamw(h.learning_rate, b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root, weight_decay=h.weight_decay)
  params = params_of(model)
  grads = nnx.to_pure_dict(nnx.grad(namespace["loss_fn"])(model, namespace["x"], namespace["y"]))
  updates, _ = ref.update(grads, ref.init(params), params)
  return optax.apply_updates(params, updates)


def test_the_sections_examples_run_and_take_optax_steps():
  blocks = section_blocks()
  assert len(blocks) == 6 and all(len(b.strip().splitlines()) <= 22 for b in blocks)
  rng = np.random.default_rng()
  namespace: dict = {}
  exec(compile(blocks[0], "api.md: Flax NNX, the model", "exec"), namespace)
  namespace["model"] = namespace["MLP"](nnx.Rngs(int(rng.integers(2**31))))  # fresh parameters and data
  namespace["x"], namespace["y"] = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 4), (16, 1)))
  for i, block in enumerate(blocks[1:4], start=1):
    before = copy_of(namespace["model"])
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      exec(compile(block, f"api.md: Flax NNX, example {i}", "exec"), namespace)
    expected = optax_step(before, namespace)
    assert max_rel_diff(params_of(namespace["model"]), expected) <= 1e-6, f"example {i}"
    said = [w for w in caught if issubclass(w.category, jax_dos.TracedUpdateWarning)]
    offloaded = any(p != "device" for p in jax_dos.get_plan(namespace["tx"], params_of(before)).placements)
    assert len(said) == (int(offloaded) if "@nnx.jit" in block else 0), f"example {i}"
    assert np.isfinite(float(namespace["loss"]))


def test_the_adapters_example_trains_as_optax_chain():
  blocks = section_blocks()
  rng = np.random.default_rng()
  namespace: dict = {}
  exec(compile(blocks[0], "api.md: Flax NNX, the model", "exec"), namespace)
  exec(compile(blocks[4], "api.md: Flax NNX, the staged model", "exec"), namespace)
  net = namespace["net"] = namespace["Net"](nnx.Rngs(int(rng.integers(2**31))))  # fresh parameters and data
  x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 4), (16, 1)))
  namespace["x"], namespace["y"] = x, y
  graphdef, params = nnx.split(net, nnx.Param)
  params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params))
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
  loss = lambda p, x, y: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)  # noqa: E731
  state = ref.init(params)
  halves = [(x[:8], y[:8]), (x[8:], y[8:])]  # OverlappedStep's two micro-batches
  for _ in range(3):
    grads = jax.tree.map(lambda a, b: (a + b) / 2, *(jax.grad(loss)(params, *h) for h in halves))
    updates, state = ref.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  exec(compile(blocks[5], "api.md: Flax NNX, the adapter", "exec"), namespace)
  assert max_rel_diff(params_of(namespace["net"]), params) <= 1e-5
  assert np.isfinite(float(namespace["loss"]))
