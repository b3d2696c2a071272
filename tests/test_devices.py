"""One process of several devices: ``python -m train.gpt`` on all of them by default, its gradients reduce-scattered,
its relayouts on the devices.

The device count is fixed when jax starts, so each check runs in a fresh
interpreter of 2 or 4 CPU devices (``--devices K`` sets it for ``train.gpt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from train import parallel
from train.flags import parse_args

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, optax, sys
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_dos
    from jax_dos.core import partition
    from models import gpt
    from train import gradients

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    one = jax.devices()[0]
    rng = np.random.default_rng()

    # A relayout moves accelerator arrays by one jitted copy, never through jax.device_put (which copies a fully
    # addressable array through the host in one process of several devices).
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 6)), jnp.float32), NamedSharding(mesh, P()))
    share = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data")))
    real_put = jax.device_put
    def no_put(xs, *a, **k):
      raise AssertionError("jax.device_put called for an accelerator array")
    jax.device_put = no_put
    try:
      (y,) = partition.relaid([x], [share])
      (z,) = partition.relaid([y], [x])
    finally:
      jax.device_put = real_put
    assert y.sharding.is_equivalent_to(share.sharding, 2) and z.sharding.is_equivalent_to(x.sharding, 2)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(x))
    print("ok relaid on the devices")

    # The plain step's accumulated gradients, on the mesh: reduce-scattered into the partitioned state's layout,
    # the same sums as on one device; the step's memory a device counts its share of the sum.
    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, remat="full")
    graphdef, params = gpt.init_params(cfg, seed=1)
    meshed = jax.device_put(params, NamedSharding(mesh, P()))
    tokens = jnp.asarray(rng.integers(0, 64, (8, 16)), jnp.int32)
    batch = (tokens, jnp.roll(tokens, -1, axis=1))
    rows = NamedSharding(mesh, P("data"))
    tx = jax_dos.interleaved_adam(1e-3, plan="host")
    loss1, sums1, scale1, norm1 = gradients.make_grad_step(tx, params, "none", 2)(graphdef, params, batch, 1.0)
    step = gradients.make_grad_step(tx, meshed, "none", 2)
    loss2, sums2, scale2, norm2 = step(graphdef, meshed, jax.device_put(batch, rows), 1.0)
    for s, want in zip(jax.tree.leaves(sums2), jax.tree.leaves(jax_dos.state_shardings(meshed))):
      assert s.sharding.is_equivalent_to(want, s.ndim), (s.sharding, want)
    assert any(len(s.sharding.spec) and s.sharding.spec[0] == "data" for s in jax.tree.leaves(sums2))
    for a, b in zip(jax.tree.leaves(sums1), jax.tree.leaves(sums2)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose([float(loss2), float(norm2)], [float(loss1), float(norm1)], rtol=1e-5)
    whole = gradients.gradient_step_memory(graphdef, params, (8, 16), 1.0, "none", 2)
    halves = gradients.gradient_step_memory(graphdef, meshed, (16, 16), 1.0, "none", 2, rows)  # 8 rows a device
    assert halves.live_bytes < whole.live_bytes and halves.peak_bytes < whole.peak_bytes, (halves, whole)
    # With the parameters sharded over every device (--mesh fsdp=2), compiled for its memory from the arrays' own
    # layouts: the running sum keeps each parameter's sharding (the GPU's setup path; the CPU trains without it).
    from train import parallel
    fsdp = parallel.make_mesh({"data": 1, "fsdp": 2})
    sharded = jax.device_put(params, parallel.param_shardings(fsdp, params))
    split = gradients.gradient_step_memory(graphdef, sharded, (16, 16), 1.0, "none", 2, parallel.batch_sharding(fsdp))
    assert split.live_bytes < whole.live_bytes, (split, whole)
    print("ok reduce-scattered sums")

    # A CPU mesh needs no compiler option to keep its rematerialisation; one device needs none anywhere.
    assert jax_dos.remat_compiler_options(rows) == {} and jax_dos.remat_compiler_options(None) == {}
    print("ok options")

    # The devices' link, measured by one all-gather: a finite rate, and a mesh's collectives (one process: both of
    # its devices share the host); one device has none.
    link = jax_dos.measure_link(mesh, bytes_per_device=2**20, repeats=2)
    assert 0 < link < float("inf"), link
    dp = jax_dos.mesh_collectives(mesh, link=link)
    assert (dp.ranks, dp.ranks_per_host, dp.link, dp.partitioned) == (2, 2, link, True), dp
    assert jax_dos.mesh_collectives(Mesh(np.array(jax.devices()[:1]), ("data",))) is None
    assert jax_dos.mesh_collectives(None) is None
    print("ok link")
  """
)


def test_relayouts_and_reduce_scattered_gradients_on_two_devices(two_devices):
  out = two_devices.run(SCRIPT, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert out.stdout.count("ok ") == 4, out.stdout


class _Gpus:  # what remat_compiler_options reads of a sharding: its devices, here of platform "gpu"
  def __init__(self, n: int):
    self.device_set = {type("Gpu", (), {"platform": "gpu", "id": i})() for i in range(n)}


def test_a_gpu_mesh_compiles_its_gradient_programs_with_the_latency_hiding_scheduler_off():
  import jax_dos

  assert jax_dos.remat_compiler_options(_Gpus(2)) == {"xla_gpu_enable_latency_hiding_scheduler": False}
  assert jax_dos.remat_compiler_options(_Gpus(1)) == {}


# A GPT small enough that a run takes seconds; a step is 2 micro-batches of 8 rows over however many devices. Its
# gradient norm falls from 1.90 to 1.79 and 1.58: a clip of 1.85 fires in the first step only.
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "16", "--grad-accum", "2", "--steps", "3",
        "--eval-batches", "1", "--eval-every", "0", "--log-every", "1", "--no-ckpt", "--clip", "1.85",
        "--param-dtype", "float32"]  # fmt: skip


RUNS = textwrap.dedent(
  """
    import json, sys
    from train import gpt

    for argv in json.loads(sys.argv[1]):  # one after another, on this interpreter's devices
      print(sys.argv[2], file=sys.stderr, flush=True)
      gpt.main(argv)
  """
)
SEPARATOR = "----- next run -----"


def _train(tmp_path: Path, runs: dict[str, list[str]], host=None) -> dict[str, tuple[dict[int, dict], str]]:
  """``train.gpt``'s ``runs`` (``{name: flags}``, each ``--devices`` the same) one after another in one interpreter:
  ``host`` (a ``script_host.ScriptHost`` of that many devices), or a fresh one started with no device count (each
  run's ``--devices K`` sets it); each run's metrics rows by step and its output, by name."""
  argvs = [[*TINY, "--out", str(tmp_path / name), *flags] for name, flags in runs.items()]
  if host is not None:
    out = host.run(RUNS, json.dumps(argvs), SEPARATOR, timeout=300)
  else:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    command = [sys.executable, "-c", RUNS, json.dumps(argvs), SEPARATOR]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  said = out.stderr.split(SEPARATOR + "\n")[1:]
  assert len(said) == len(runs), out.stderr[-3000:]
  results = {}
  for name, text in zip(runs, said):
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    results[name] = {r["step"]: r for r in rows if "loss" in r}, text
  return results


def _train_here(tmp_path: Path, name: str, *flags: str) -> dict[int, dict]:
  """``train.gpt`` on this process's one device; its metrics rows by step."""
  from train import gpt

  gpt.main([*TINY, "--out", str(tmp_path / name), *flags])
  rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in rows if "loss" in r}


def test_all_devices_by_default_train_as_one_device_with_the_same_global_batch(tmp_path, two_devices):
  """One process of 2 and of 4 CPU devices (``--devices K``; every device is the default) trains as one device (this
  process) with the same 8 rows a micro-batch (``--batch`` rows a device), on the plain step and on the overlapped
  one, also with the parameters sharded (``--mesh fsdp=4``, ``data=2,fsdp=2``), the clip firing in the first step and
  silent after it (the overlapped step then speculates): the same losses and gradient norms, to float32 rounding. The
  runs of 4 devices share one interpreter started with no device count (the device count is fixed when jax starts;
  ``--devices 4`` sets it); the run of 2 runs in the ``two_devices`` interpreter."""
  import jax

  assert jax.device_count() == 1, jax.devices()
  one = _train_here(tmp_path, "one", "--batch", "8", "--quiet")
  assert [one[s]["clipped"] for s in (1, 2, 3)] == [True, False, False], one
  two, said = _train(tmp_path, {"two": ["--devices", "2", "--batch", "4"]}, two_devices)["two"]
  assert "devices 2 x cpu, all 2 of the job's, data-parallel (--mesh data=2" in said, said
  assert "a step 16 x 16 = 256 tokens" in said, said
  # The parameters sharded too (issue 50's layouts): over fsdp=4, and over data=2 x fsdp=2, on the overlapped step.
  meshes = {"fsdp=4": "fsdp4", "data=2,fsdp=2": "data2_fsdp2"}
  four_devices = ["--devices", "4", "--batch", "2", "--overlap", "on"]
  runs = _train(tmp_path, {"four": four_devices} | {name: [*four_devices, "--mesh", m] for m, name in meshes.items()})
  four, said = runs["four"]
  assert "step    overlapped (--overlap on)" in said, said
  sharded = []
  for mesh, name in meshes.items():
    run, said = runs[name]
    assert f"--mesh {'data=1,' if mesh == 'fsdp=4' else ''}{mesh}" in said and "step    overlapped" in said, said
    sharded.append(run)
  for other in (two, four, *sharded):
    assert sorted(other) == [1, 2, 3]
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose([other[s][key] for s in one], [one[s][key] for s in one], rtol=1e-5)


def test_devices_flag_refusals(capsys):
  with pytest.raises(SystemExit):
    parse_args(["--devices", "2"])
  assert "--devices 2: this process has 1 device(s)" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="give each process its GPUs"):
    parallel.select_devices(2, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
  with pytest.raises(SystemExit, match="--devices must be >= 1"):
    parallel.select_devices(0, {})
