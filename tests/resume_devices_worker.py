"""``python -m train.gpt`` checkpoints saved on N devices and resumed on M, for ``test_train_resume.py``.

``python tests/resume_devices_worker.py STAGE DIR`` runs the training script in this process (CPU devices from
``XLA_FLAGS``), several times, each run in ``DIR/<name>`` (``test_train_resume.py`` runs ``two`` so, and ``one`` in its
own process of one device through :func:`main`); every run takes the same 4 rows a step (``--batch`` rows a
device), so its batches do not depend on the device count. ``STAGE``:

- ``two`` (2 devices): 4 steps with checkpoints at steps 2 and 4 on ``--mesh data=2 --overlap off`` (``s2off``: the
  state partitioned over ``data``) and on ``--mesh fsdp=2 --overlap on`` (``s2on``: parameters and state sharded);
  ``s2off``'s step 2 resumed with bfloat16 moments on ``--mesh data=2`` (``r2bf16``: converted onto the mesh); and
  ``--moments int8`` on the mesh refused before anything is read or written.
- ``one`` (1 device): ``s2off``'s step 2 resumed with float32 moments (``r2to1``), ``s2on``'s with int8 moments on the
  overlapped step (``r2int8``: issue 50's 13B case, 2 GPUs to 1 with int8 moments).

(4 devices to 2 through the script: ``test_multiprocess.py``, 2 processes of 2 devices resumed as 2 of 1.)

Each resume is checked as it restores (``train.checkpoints.restore`` watched, nothing changed): the parameters and
master weights equal the checkpoint's bit for bit (read back by Orbax alone, as numpy), and the moments too, or, where
the format changes, equal the saved moments converted by ``jax_dos.core.moment_formats``' own functions (the step count
as the seed). The losses are compared by the test, from each run's ``metrics.jsonl``. Prints ``ok <name>`` per run.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys

import jax
import numpy as np

STEPS = ["--steps", "4", "--decay-steps", "4", "--warmup", "1"]
FLAGS = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "16", "--eval-batches", "1", "--eval-every",
         "0", "--log-every", "1", "--param-dtype", "float32", "--offload", "host", "--quiet", *STEPS]  # fmt: skip
ROWS = 4  # a step's rows, on any device count


def run(directory: str, name: str, devices: int, *flags: str) -> dict:
  from train import gpt

  return gpt.main([*FLAGS, "--batch", str(ROWS // devices), "--out", os.path.join(directory, name), *flags])


def key(path: tuple) -> str:
  """A tree path as ``a/b/0``, whatever kind of keys it has."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def flat(tree) -> dict[str, np.ndarray]:
  """Copies of ``tree``'s leaves by path (a host array's ``np.asarray`` is a view the next update overwrites)."""
  return {key(p): np.array(x, copy=True) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def saved(ckpt: str, step: int) -> dict[str, dict[str, np.ndarray]]:
  """A step's ``params``, ``master`` and ``opt_state`` as Orbax reads them as numpy, without jax_dos."""
  import orbax.checkpoint as ocp

  names = ("params", "master", "opt_state")
  reader = ocp.CheckpointManager(ckpt, item_handlers={name: ocp.PyTreeCheckpointHandler() for name in names})
  items = {}
  for name in names:
    tree = reader.item_metadata(step)[name]
    leaves = ocp.tree.to_flat_dict(getattr(tree, "tree", tree))
    item = ocp.tree.from_flat_dict({k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in leaves.items()})
    args = ocp.tree.from_flat_dict({k: ocp.RestoreArgs(restore_type=np.ndarray) for k in leaves})
    items[name] = ocp.args.PyTreeRestore(item, restore_args=args)
  out = reader.restore(step, args=ocp.args.Composite(**items))
  reader.close()
  return {name: flat(out[name]) for name in names}


def watched_restore(into: list):
  """``train.checkpoints.restore`` as it is, recording what it restored (as numpy) in ``into``."""
  from train import checkpoints

  real = checkpoints.restore

  def restore(*args, **kwargs):
    params, state, step, config = real(*args, **kwargs)
    into.append({"params": flat(params), "master": flat(state.master), "mu": flat(state.mu), "nu": flat(state.nu)})
    return params, state, step, config

  checkpoints.restore = restore
  return real


def resume(directory: str, source: str, name: str, devices: int, moments: str, *flags: str) -> dict:
  """Resumes ``source``'s step 2 (a copy without its later step) in ``name``; checks what was restored."""
  from jax_dos.core import moment_formats as mf
  from train import checkpoints

  shutil.copytree(os.path.join(directory, source), os.path.join(directory, name))
  shutil.rmtree(os.path.join(directory, name, "ckpt", "4"))
  disk = saved(os.path.join(directory, name, "ckpt"), 2)
  restored: list = []
  real = watched_restore(restored)
  try:
    result = run(directory, name, devices, "--resume", "--moments", moments, *flags)
  finally:
    checkpoints.restore = real
  assert result["start_step"] == 2 and result["step"] == 4, result
  (got,) = restored
  for tree, want in (("params", disk["params"]), ("master", disk["master"])):
    assert sorted(got[tree]) == sorted(want), (tree, sorted(got[tree]), sorted(want))
    for k, x in want.items():
      np.testing.assert_array_equal(got[tree][k], x, err_msg=f"{name} {tree}/{k}")
  count = int(disk["opt_state"]["count"])
  assert count == 2, count
  for salt, moment in enumerate(("mu", "nu")):
    for k, x in got[moment].items():
      want = disk["opt_state"][f"{moment}/{k}"]  # float32, as every save here
      if moments != "float32":
        want = mf.host_encode(want, moments, float(count), salt).reshape(x.shape)
      assert x.dtype == mf.stored_dtype(moments), (name, moment, k, x.dtype)
      np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8), err_msg=f"{name} {moment}/{k}")
  print(f"ok {name}", flush=True)
  return result


def main(stage: str, directory: str) -> None:
  devices = jax.device_count()
  save = ["--ckpt-every", "2"]
  if stage == "two":
    assert devices == 2, jax.devices()
    run(directory, "s2off", 2, "--mesh", "data=2", "--overlap", "off", *save)
    run(directory, "s2on", 2, "--mesh", "fsdp=2", "--overlap", "on", *save)
    print("ok saved", flush=True)
    resume(directory, "s2off", "r2bf16", 2, "bfloat16", "--mesh", "data=2", "--overlap", "off")
    # Bad input: int8 moments cannot lie on a mesh. Refused with what to change; the checkpoint is as it was.
    ckpt = os.path.join(directory, "s2off", "ckpt")
    listing = lambda: {  # noqa: E731
      os.path.join(root, f): (os.stat(os.path.join(root, f)).st_size, os.stat(os.path.join(root, f)).st_mtime_ns)
      for root, _, files in os.walk(ckpt)
      for f in files
    }
    before = listing()
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.suppress(SystemExit):
      run(directory, "s2off", 2, "--mesh", "data=2", "--moments", "int8", "--resume")
    assert "--moments int8" in said.getvalue() and "--moments bfloat16" in said.getvalue(), said.getvalue()
    assert listing() == before
    print("ok int8 on a mesh refused", flush=True)
  elif stage == "one":
    assert devices == 1, jax.devices()
    resume(directory, "s2off", "r2to1", 1, "float32", "--overlap", "off")
    resume(directory, "s2on", "r2int8", 1, "int8", "--overlap", "on")
  else:
    raise SystemExit(f"unknown stage {stage!r}")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
