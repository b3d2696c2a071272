"""Set-up shared by every test of a run, and by the interpreters the tests start.

One persistent compilation cache for the whole run (every pytest-xdist worker and every subprocess a test starts
inherits it through the environment): the tests build the same small programs again and again (each
``train.gpt`` run, each subprocess, each worker), and XLA compiles each once. The cache is a fresh directory
removed at the end, so a run never reads programs compiled by an earlier one; a ``JAX_COMPILATION_CACHE_DIR``
given by the caller is used as it is.

XLA compiles the tests' programs at backend optimization level 0, with its CPU backend's loop emitters instead of its
fusion emitters, each program's code generated in one piece (``COMPILE_FLAGS``, added to ``XLA_FLAGS`` for the run
and every interpreter it starts): the programs are tiny and compiling them is most of the suite's time. Without the
fusion emitters ``test_remat.py`` and ``test_overlap_numbers.py`` took 40 % less CPU time (27 s, not 46 s), and the
suite's other in-process tests about as much; in one piece, those two files' compilations took a third less time
for the same CPU time (10 s, not 15 s: no threads of their own to wait for on two cores). Unoptimized programs fuse
no multiply-adds: a result may differ from an optimized build's in its last bits, which no test compares against
(tests compare programs compiled alike, or within tolerances).

Before pytest-xdist starts its workers, two interpreters fill numba's cache with every host kernel the tests run
(``numba_warmup.py``), so that no two processes compile one kernel at once.

Scripts that need an interpreter of their own only for its device count (a mesh of 2 or 4 CPU devices), and the
benchmark scripts, run in one interpreter of that kind a worker (``four_devices``, ``two_devices``, ``bench_host``:
``script_host.py``), one script after another, instead of paying jax's start in a fresh interpreter each.

The longest tests run first (``RUN_FIRST``), so that pytest-xdist's workers (``-n 2`` in pyproject.toml) share out
the short ones after them instead of one worker finishing a long test alone at the end.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
OWNED_ENV = "JAX_DOS_TESTS_OWN_CACHE"  # set when this test run made the directory (and removes it)
# Each flag is added where the caller's XLA_FLAGS do not set it already.
COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)

# Node id prefixes of the longest tests (each runs for tens of seconds: subprocesses, whole training runs), longest
# first. Only the order depends on it: a test missing here runs all the same, after these.
RUN_FIRST = (
  "tests/test_multiprocess.py::test_train_gpt_on_two_processes_matches_one_and_resumes",
  "tests/test_bench_smoke.py::test_train_step_smoke",  # the xdist_group train_step_smoke: one run for two tests
  "tests/test_multiprocess.py",  # the xdist_group two_processes: one job for four tests
  "tests/test_stage_rng.py::test_dropout_on_a_data_parallel_mesh",
  "tests/test_devices.py::test_all_devices_by_default",
  "tests/test_overlap_numbers.py::test_sharded_on_four_devices",
  "tests/test_bench_smoke.py::test_scale_out_smoke",
  "tests/test_fine_tune.py::test_init_from",
  "tests/test_overlap_machinery.py::test_leaving_python",
  "tests/test_train_resume.py::test_a_checkpoint_saved_on_two_devices",
  "tests/test_partition.py",
  "tests/test_sharding.py",
  "tests/test_peers.py::test_run_all_smoke",
  "tests/test_bench_smoke.py",
  "tests/test_devices.py",
  "tests/test_train_resume.py::test_resume_is_bit_exact",
  "tests/test_train_resume.py::test_a_first_save_killed_midway",
  "tests/test_interleaved_adam.py::test_matches_optax[multi_steps",
  "tests/test_interleaved_adam.py::test_optax_multisteps",
  "tests/test_train_steps.py",
  "tests/test_train_resume.py",
  "tests/test_train_script.py",
  "tests/test_checkpoint.py::test_kill_during_save",
  "tests/test_checkpoint.py::test_sharded_restore",
)


def pytest_configure(config):
  if not hasattr(config, "workerinput") and not os.environ.get(CACHE_ENV):  # the controller (or a run without -n)
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="jax-dos-tests-compilation-cache-")
    os.environ[OWNED_ENV] = "1"
  if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
    _fill_numba_cache()
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the tests' programs compile quickly
  flags = os.environ.get("XLA_FLAGS", "")
  given = {f.split("=")[0] for f in flags.split()}  # a value given by the caller is kept
  on_cpu = _on_cpu()
  ours = [f for f in COMPILE_FLAGS if f.split("=")[0] not in given and (on_cpu or not f.startswith("--xla_cpu_"))]
  os.environ["XLA_FLAGS"] = " ".join([flags, *ours]).strip()
  import jax

  jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
  # float32 products in float32 on every backend (a GPU's default is TF32): the tests compare to float32 rounding
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
  )


def _on_cpu() -> bool:
  """Whether jax runs these tests on the CPU backend: ``JAX_PLATFORMS`` names it first, or no CUDA plugin is
  installed. A GPU plugin's XLA ends the process on a CPU compiler flag it does not know."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  try:
    import jax_plugins
  except ImportError:
    return True
  import pkgutil

  return not any("cuda" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


def _fill_numba_cache() -> None:
  """Every host kernel the tests run compiled into numba's cache (or found there) by two interpreters side by side,
  before pytest-xdist starts its workers (``numba_warmup.py`` says why); a share that fails says so and the tests
  compile what they need as before."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  script = os.path.join(root, "tests", "numba_warmup.py")
  shares = [subprocess.Popen([sys.executable, script, str(i)], cwd=root, env=env, stderr=subprocess.PIPE, text=True)
            for i in range(2)]  # fmt: skip
  for i, share in enumerate(shares):
    _, err = share.communicate()
    if share.returncode:
      logging.getLogger(__name__).warning("numba_warmup.py %d failed:\n%s", i, err[-3000:])


def pytest_collection_modifyitems(config, items):
  def rank(item) -> int:
    return next((i for i, prefix in enumerate(RUN_FIRST) if item.nodeid.startswith(prefix)), len(RUN_FIRST))

  items.sort(key=rank)  # stable: collection order within a rank
  if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker of a run with --dist loadgroup
    _name_xdist_groups(items)


def _name_xdist_groups(items) -> None:
  """Each item marked ``xdist_group`` gets its group's name after its node id (``...@group``), as pytest-xdist's worker
  writes it for the controller, whose ``--dist loadgroup`` sends the tests of one group to one worker. pytest 9.2 keeps
  a node's id in ``Item._id`` (a ``NodeId``), so pytest-xdist 3.8's write (to ``Item._nodeid``) is lost and every test
  goes out alone (pytest-dev/pytest-xdist#1386): the module fixtures of a group ran once on each worker. Nothing to do
  where pytest-xdist's write took (an older pytest) or a later one writes it."""
  try:
    from _pytest.nodeid import NodeId
  except ImportError:  # pytest before 9.2: pytest-xdist names the groups
    return
  for item in items:
    groups = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    if groups and item.nodeid.rfind("@") <= item.nodeid.rfind("]") and isinstance(getattr(item, "_id", None), NodeId):
      item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(groups))}")


def pytest_unconfigure(config):
  if not hasattr(config, "workerinput") and os.environ.pop(OWNED_ENV, None):
    shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)


@functools.cache
def _this_machines_calibration():
  import jax_dos

  return jax_dos.calibrate()


@pytest.fixture(scope="session")
def calibration():
  """This machine's calibration for the performance model, measured once a worker (``jax_dos.calibrate``'s
  cache)."""
  return _this_machines_calibration()


def _hosted(devices):
  """A ``script_host.ScriptHost`` of ``devices`` CPU devices (``None``: this process's environment), closed after."""
  from script_host import ScriptHost

  host = ScriptHost(devices)
  yield host
  host.close()


@pytest.fixture(scope="session")
def four_devices():
  """One interpreter of 4 CPU devices a worker, which runs the tests' mesh scripts in turn (``script_host.py``)."""
  yield from _hosted(4)


@pytest.fixture(scope="session")
def bench_host():
  """One interpreter a worker, of this process's environment, for the benchmark scripts (``script_host.py``)."""
  yield from _hosted(None)


@pytest.fixture(scope="session")
def two_devices():
  """One interpreter of 2 CPU devices a worker, for the scripts that take every device of 2 (``script_host.py``)."""
  yield from _hosted(2)


@pytest.fixture
def calibrated_cache(tmp_path, calibration):
  """``tmp_path / "cache"``, an ``XDG_CACHE_HOME`` holding this machine's calibration: a script run with it plans
  from the cached rates instead of measuring them again (``test_calibration.py`` tests the measuring)."""
  from helpers import cache_calibration

  return cache_calibration(tmp_path / "cache", calibration)


@pytest.fixture(autouse=True)
def library_logging_as_it_was():
  """A test that runs ``train.gpt`` in-process routes ``jax_dos``'s records to the script's own handler
  (``train.progress.show_library_notes``: no longer propagated to the root logger, where ``caplog`` listens); each
  test starts with the ``jax_dos`` logger at its defaults, whichever tests or module fixtures (``test_train_resume``'s
  runs) ran before it on its worker, and leaves it as it found it."""
  logger = logging.getLogger("jax_dos")
  level, propagate, handlers = logger.level, logger.propagate, list(logger.handlers)
  logger.setLevel(logging.NOTSET)
  logger.propagate = True
  logger.handlers[:] = []
  yield
  logger.setLevel(level)
  logger.propagate = propagate
  logger.handlers[:] = handlers
