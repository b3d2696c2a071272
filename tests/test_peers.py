"""bench/peers: the torch GPT is models/gpt.py's model, the host-memory check refuses what cannot fit, the table.

The torch tests skip where torch is not installed (CI installs no torch); the rest need only the project.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from models import gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "bench", "peers")
sys.path.insert(0, PEERS)
import host_memory  # noqa: E402
import peers  # noqa: E402
import run_all  # noqa: E402

GIB = 2**30
VARIANTS = [dict(), dict(vocab_size=50304), dict(bias=False), dict(norm="rmsnorm"), dict(norm="rmsnorm", bias=False)]


@pytest.mark.parametrize("preset", sorted(gpt.PRESETS))
@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_param_shapes_count_as_models_gpt(preset, overrides):
  cfg = gpt.get_config(preset, **overrides)
  shapes = host_memory.param_shapes(cfg)
  assert sum(host_memory.numel(s) for s in shapes) == gpt.param_count(cfg)
  # Every block has the same shapes: two blocks of the preset's widths compare them all (tracing all 40 does not).
  two = gpt.get_config(preset, **overrides, n_layer=2)
  shapes = host_memory.param_shapes(two)
  flax_shapes = sorted(x.shape for x in jax.tree.leaves(gpt.abstract_params(two)))
  torch_as_flax = sorted(shapes[:2] + [s[::-1] for s in shapes[2:]])  # embeddings; Linear [out, in] is [in, out]
  assert torch_as_flax == flax_shapes


@pytest.mark.parametrize("preset", sorted(gpt.PRESETS))
@pytest.mark.parametrize("overrides", VARIANTS[:3], ids=["default", "vocab_size=50304", "bias=False"])
def test_torch_gpt_parameters_are_models_gpt(preset, overrides):
  torch = pytest.importorskip("torch")
  import torch_gpt

  cfg = gpt.get_config(preset, dtype="bfloat16", param_dtype="bfloat16", remat=True, **overrides)
  with torch.device("meta"):  # no memory, even for 6.7B
    model = torch_gpt.TorchGPT(cfg)
  assert torch_gpt.count_params(model) == gpt.param_count(cfg)
  assert [tuple(p.shape) for p in model.parameters()] == host_memory.param_shapes(cfg)
  assert all(p.dtype == torch.bfloat16 for p in model.parameters())
  decay, rest = torch_gpt.param_groups(model, 0.1)
  assert sum(p.numel() for p in decay["params"]) == host_memory.decay_split(host_memory.param_shapes(cfg))[0]
  assert (decay["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("remat", [False, True])
def test_torch_gpt_computes_models_gpt(norm, remat):
  """Same weights, same tokens: the torch model's loss and every gradient are those of the Flax model (float32)."""
  torch = pytest.importorskip("torch")
  import torch_gpt

  cfg = gpt.get_config("tiny", n_layer=2, block_size=32, norm=norm, remat=remat)
  graphdef, params = gpt.init_params(cfg, seed=random.randrange(2**31))
  rng = np.random.default_rng(random.randrange(2**31))
  tokens = rng.integers(0, cfg.vocab_size, (3, 33))
  x, y = tokens[:, :-1], tokens[:, 1:]
  loss, grads = jax.value_and_grad(gpt.loss, argnums=1)(graphdef, params, (x, y))

  torch.manual_seed(0)
  model = torch_gpt.TorchGPT(cfg)
  torch_gpt.load_flax(model, params)
  for name, p in model.named_parameters():  # the copy itself, leaf by leaf
    np.testing.assert_array_equal(p.detach().numpy(), np.asarray(torch_gpt.flax_leaf(model, name, params)))
  torch_loss = model(torch.as_tensor(x), torch.as_tensor(y))
  torch_loss.backward()
  np.testing.assert_allclose(float(torch_loss.detach()), float(loss), rtol=1e-5)
  logits = nnx.merge(graphdef, params)(x)
  np.testing.assert_allclose(model(torch.as_tensor(x)).detach().numpy(), np.asarray(logits), rtol=1e-4, atol=1e-5)
  for name, p in model.named_parameters():
    expected = np.asarray(torch_gpt.flax_leaf(model, name, grads))
    scale = np.abs(expected).max()
    np.testing.assert_allclose(p.grad.numpy(), expected, atol=1e-4 * scale, err_msg=name)


def test_torch_gpt_initialisation_is_gpt2():
  torch = pytest.importorskip("torch")
  import torch_gpt

  cfg = gpt.get_config("small", vocab_size=512)
  torch.manual_seed(random.randrange(2**31))
  model = torch_gpt.TorchGPT(cfg)
  residual = 0.02 / np.sqrt(2 * cfg.n_layer)
  for name, p in model.named_parameters():
    v = p.detach().numpy()
    if name.endswith("bias") or (name.endswith("weight") and p.ndim == 1):
      np.testing.assert_array_equal(v, np.zeros_like(v) if name.endswith("bias") else np.ones_like(v), err_msg=name)
    else:
      std = residual if name.endswith("proj.weight") else 0.02
      assert abs(v.std() / std - 1) < 0.05, (name, v.std(), std)


# ----------------------------------------------------------------------------- host memory


def test_pinned_bytes_is_the_next_power_of_two():
  for n in [random.randrange(1, 2**40) for _ in range(200)] + [1, 2, 3, 4096, 4097]:
    b = host_memory.pinned_bytes(n)
    assert b >= n and b & (b - 1) == 0 and b // 2 < n


def test_host_limit_prefers_the_cgroup():
  total_kib = random.randrange(2**20, 2**28)
  meminfo = f"MemTotal:       {total_kib} kB\nMemFree:        1234 kB\n"
  cgroup = random.randrange(2**30, 2**40)
  assert host_memory.host_limit(meminfo, None) == total_kib * 1024
  assert host_memory.host_limit(meminfo, "max\n") == total_kib * 1024
  assert host_memory.host_limit(meminfo, f"{cgroup}\n") == cgroup
  with pytest.raises(ValueError, match="MemTotal"):
    host_memory.host_limit("MemFree: 1 kB\n", None)
  assert host_memory.read_host_limit() > 0


def test_refusal_iff_the_estimate_does_not_fit():
  for _ in range(200):
    need, limit = random.randrange(2**40), random.randrange(2**40)
    message = host_memory.refusal("zero2", need, limit, "change this")
    assert (message is None) == (need <= limit - host_memory.RESERVE_BYTES)
    if message:
      assert "change this" in message and f"{need / GIB:.1f} GiB" in message


def test_estimates_grow_with_what_each_system_keeps_on_the_host():
  shapes = host_memory.param_shapes(gpt.get_config("gpt-6.7b", vocab_size=50304))
  n = sum(host_memory.numel(s) for s in shapes)
  one, two = host_memory.zero2_bytes(shapes, 1), host_memory.zero2_bytes(shapes, 2)
  assert one - host_memory.PROCESS_BYTES >= 16 * n  # fp32 master + fp32 gradients + two fp32 moments
  assert two - one == sum(host_memory.pinned_bytes(4 * host_memory.numel(s)) for s in shapes)
  assert host_memory.zero2_bytes(shapes, 4) == two  # one accumulation buffer, whatever the number of micro-batches
  r = random.random()
  assert host_memory.zero3_bytes(shapes, r) == host_memory.PROCESS_BYTES + int((4 + 16 * r) * n)
  with pytest.raises(ValueError, match="ratio"):
    host_memory.zero3_bytes(shapes, 1.5)
  bf16, fp32 = host_memory.torchao_bytes(shapes, 2), host_memory.torchao_bytes(shapes, 4)
  assert 8 * n <= bf16 - host_memory.PROCESS_BYTES < 16 * n <= fp32 - host_memory.PROCESS_BYTES
  with pytest.raises(ValueError, match="unknown system"):
    host_memory.estimate("zero9", shapes)


def _args(system, *extra):
  return peers.parse_args(["--system", system, "--out", "unused.json", *extra])


def test_host_check_refuses_and_falls_back():
  cfg = gpt.get_config("gpt-6.7b", vocab_size=50304, block_size=2048)
  shapes = host_memory.param_shapes(cfg)
  one, two = host_memory.zero2_bytes(shapes, 1), host_memory.zero2_bytes(shapes, 2)
  limit = (one + two) // 2 + host_memory.RESERVE_BYTES  # holds 16 x 1, not 8 x 2
  record = peers.host_check(_args("zero2"), cfg, limit)
  assert "--batch 16 --grad-accum 1" in record["refused"] and record["host_estimate_bytes"] == two
  args = _args("zero2", "--host-fallback")
  record = peers.host_check(args, cfg, limit)
  assert "refused" not in record and (args.batch, args.grad_accum) == (16, 1)
  assert record["layout_changed_from"] == [8, 2] and record["host_estimate_bytes"] == one
  assert "refused" in peers.host_check(_args("zero2", "--host-fallback"), cfg, one - 1)  # neither fits
  assert "refused" not in peers.host_check(_args("zero2", "--skip-host-check"), cfg, 0)
  assert "--ratio" in peers.host_check(_args("zero3"), cfg, 2 * GIB)["refused"]


def test_peers_cli_refuses_before_importing_torch(tmp_path):
  """At 6.7B ZeRO-2 with 8 x 2 needs ~146 GiB of host memory: refused (exit 3) with the reason in the JSON."""
  cfg = gpt.get_config("gpt-6.7b", vocab_size=50304, block_size=2048)
  need = host_memory.zero2_bytes(host_memory.param_shapes(cfg), 2)
  if host_memory.refusal("zero2", need, host_memory.read_host_limit(), "") is None:
    pytest.skip("this machine holds ZeRO-2 at 6.7B")
  out = tmp_path / "zero2.json"
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(
    [sys.executable, os.path.join(PEERS, "peers.py"), "--system", "zero2", "--out", str(out)],
    env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == peers.EXIT_REFUSED, proc.stderr[-2000:]
  doc = json.loads(out.read_text())
  assert doc["host_estimate_bytes"] == need and "--grad-accum 1" in doc["refused"]
  assert "torch" not in doc  # refused before torch was imported


def _smoke(tmp_path, system, *extra):
  deepspeed = system.startswith("zero")
  for module in ("torch", "deepspeed") if deepspeed else ("torch",):
    if importlib.util.find_spec(module) is None:
      pytest.skip(f"{module} is not installed")
  out = tmp_path / f"{system}.json"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]))
  if deepspeed and not _has_cuda():
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator, gloo
  proc = subprocess.run(
    [sys.executable, os.path.join(PEERS, "peers.py"), "--system", system, "--smoke", "--out", str(out), *extra],
    env=env, capture_output=True, text=True, timeout=900,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  doc = json.loads(out.read_text())
  assert doc["loss_fell"] and len(doc["losses"]) == 3 and doc["num_params"] == gpt.param_count(gpt.get_config("tiny"))
  assert doc["tokens_per_s"] > 0 and doc["host_rss_peak_bytes"] > 0
  assert all(s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0 for s in doc["steps"])
  return doc


def test_peers_torch_smoke_trains(tmp_path):
  """The plain-torch system end to end (CPU here): timings, memory, and the loss falls on the repeated batch."""
  _smoke(tmp_path, "torch")


@pytest.mark.parametrize("system", ["zero2", "zero3"])
def test_peers_deepspeed_smoke_trains(tmp_path, system):
  """ZeRO-Offload and ZeRO-3 with a ratio end to end, on DeepSpeed's CPU accelerator where there is no GPU.

  Builds ``cpu_adam`` on first use (1-2 minutes); skips where DeepSpeed is not installed (CI).
  """
  doc = _smoke(tmp_path, system, "--grad-accum", "2")
  zero = doc["ds_config"]["zero_optimization"]
  assert zero["offload_optimizer"]["device"] == "cpu" and zero["stage"] == (2 if system == "zero2" else 3)
  assert doc["ds_config"]["gradient_accumulation_steps"] == 2 and doc["ds_config"]["gradient_clipping"] == 1.0


def _has_cuda():
  return subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"]).returncode == 0


# ----------------------------------------------------------------------------- the table


def test_table_rows_and_ratios(tmp_path):
  peak, tps = random.uniform(500, 1000) * 1e12, {s: random.uniform(1e3, 1e4) for s in ("auto", "zero2", "torchao")}
  n, fpt = random.randrange(10**9, 10**10), random.randrange(10**10, 10**11)
  jaxdos = {
    "config": {"batch": 8, "grad_accum": 2},
    "results": [
      {"variant": "peak", "peak_flops": peak},
      {"variant": "auto", "tokens_per_s": tps["auto"], "flops_per_token": fpt, "num_params": n,
       "gpu_peak_bytes": 70 * GIB, "host_maxrss_bytes": 60 * GIB, "losses": [11.0, 9.0]},
    ],
  }  # fmt: skip
  zero2 = {
    "config": {"batch": 16, "grad_accum": 1}, "tokens_per_s": tps["zero2"], "flops_per_token": fpt, "num_params": n,
    "gpu_peak_allocated_bytes": 40 * GIB, "host_rss_peak_bytes": 110 * GIB, "loss_fell": True,
  }  # fmt: skip
  torchao = {**zero2, "config": {"batch": 8, "grad_accum": 2, "torchao_master": "bf16"}, "tokens_per_s": tps["torchao"]}
  zero3 = {"config": {"batch": 8, "grad_accum": 2, "ratio": 0.75}, "refused": "zero3 needs about 99 GiB"}
  first, second, merged = tmp_path / "call1", tmp_path / "call2", tmp_path / "merged"  # two calls, then one table
  for folder, docs in ((first, {"jaxdos": jaxdos, "torchao": torchao}), (second, {"zero2": zero2, "zero3": zero3})):
    folder.mkdir()
    for name, doc in docs.items():
      (folder / f"{name}.json").write_text(json.dumps(doc))
  (second / "torchao.json").write_text(json.dumps(zero3))  # the first folder's torchao wins
  (second / "torch.json").write_text(
    json.dumps({"config": {"batch": 8, "grad_accum": 2}, "steps": [{}, {}], "cut_short": True})
  )
  found = run_all.rows([str(first), str(second)])
  names = ["jax-dos auto", "ZeRO-Offload", "ZeRO-3 ratio 0.75", "torchao bf16, no clip", "torch, no offload"]
  assert [r["system"] for r in found] == names
  lines = run_all.table(found)
  assert f"{tps['auto'] / tps['zero2']:.2f}x" in lines[1] and "1.00x" in lines[2] and "99 GiB" in lines[3]
  assert f"{100 * fpt * tps['torchao'] / peak:.1f}%" in lines[4]  # every row's MFU against jax-dos's measured peak
  assert f"{110 * GIB / n:.1f}" in lines[2]  # host bytes per parameter
  assert "cut short after 2 steps" in lines[5]
  assert run_all.write_summary(str(merged), ["note"], dirs=[str(first), str(second)]) == lines
  summary = json.loads((merged / "summary.json").read_text())
  assert summary["notes"] == ["note"] and summary["table"] == lines


@pytest.mark.usefixtures("calibrated_cache")  # tmp_path/cache: the calibration, measured once
def test_run_all_smoke(tmp_path):
  """The driver end to end on tiny sizes: jax-dos's train_step (and plain torch where installed), then the table."""
  systems = "jaxdos" + (",torch" if importlib.util.find_spec("torch") else "")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), XDG_CACHE_HOME=str(tmp_path / "cache"))
  out = tmp_path / "peers"
  args = ["--preset", "tiny", "--batch", "2", "--grad-accum", "2", "--seq-len", "64", "--steps", "1", "--warmup", "1"]
  proc = subprocess.run(
    [sys.executable, os.path.join(PEERS, "run_all.py"), "--out", str(out), "--systems", systems,
     "--jaxdos-variants", "auto", *args],
    env=env, capture_output=True, text=True, timeout=900,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  rows = {r["system"]: r for r in summary["rows"]}
  assert set(rows) == {"jax-dos auto"} | ({"torch, no offload"} if "torch" in systems else set())
  assert all("error" not in r and r["tokens_per_s"] > 0 and r["setup"] == "2x2" for r in rows.values())
  assert summary["table"][0].startswith("system") and "jax-dos auto" in proc.stdout
  assert (out / "jaxdos.log").read_text() and len(summary["notes"]) == len(systems.split(","))
