"""Importing jax_dos (and the training script, and the models) changes no process state: no environment variable,
no XLA flag, no jax setting, no signal handler, no warnings filter, and no backend started. What XLA must read before
its backend starts is set by an explicit call (``jax_dos.configure_process``) or where the script first needs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

from jax_dos.memory import cpu_client, pinned_pool

ROOT = Path(__file__).resolve().parent.parent

SNAPSHOT = """
import json, os, signal, sys, warnings
import jax
from jax._src import xla_bridge

def snapshot():
  return {
    "environ": dict(os.environ),
    "jax config": {k: repr(v) for k, v in jax.config.values.items()},
    "signal handlers": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if hasattr(s, "name")},
    "warnings filters": [repr(f) for f in warnings.filters],
    "backend started": xla_bridge.backends_are_initialized(),
  }

before = snapshot()
import jax_dos, models.hf, train.gpt
after = snapshot()
changed = {k: [x for x in set(before[k]) | set(after[k]) if before[k].get(x) != after[k].get(x)]
           if isinstance(before[k], dict) else after[k] for k in before if before[k] != after[k]}
print(json.dumps(changed))
"""


def _fresh_interpreter(code: str, **env: str) -> str:
  clean = {k: v for k, v in os.environ.items() if k not in (pinned_pool.POOL_LIMIT_ENV, cpu_client.POOL_ENV)}
  flags = f"{clean.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()  # what size_pool acts on
  clean |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PYTHONPATH": str(ROOT), **env}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_importing_jax_dos_changes_no_process_state():
  assert json.loads(_fresh_interpreter(SNAPSHOT)) == {}


def test_configure_process_sets_what_xla_reads_at_its_start_unless_the_user_set_it():
  """``configure_process`` raises XLA's pinned pool cap (its default is 64 GiB) and sizes the CPU client's pool for
  the process's 2 CPU devices; a value the user set stays."""
  code = "import json, jax_dos; print(json.dumps(jax_dos.configure_process()))"
  set_ = json.loads(_fresh_interpreter(code))
  assert int(set_[pinned_pool.POOL_LIMIT_ENV]) >= pinned_pool.XLA_DEFAULT_POOL_GIB
  assert int(set_[cpu_client.POOL_ENV]) == cpu_client.pool_threads(2)
  assert json.loads(_fresh_interpreter(code, **{pinned_pool.POOL_LIMIT_ENV: "7", cpu_client.POOL_ENV: "3"})) == {}
