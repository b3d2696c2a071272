"""Calibration: measuring on the CPU backend, the JSON cache, and overrides."""

import dataclasses
import json
import logging
import math
import socket

import jax
import pytest

from jax_dos.planning import calibration, cost_model
from jax_dos.planning.cost_model import Calibration


def this_machine(**rates) -> Calibration:
  d = jax.devices()[0]
  return Calibration(
    host_rate=rates.get("h", 1e9),
    stream_rate=rates.get("s", 2e9),
    device_rate=1e11,
    host_rate_concurrent=5e8,
    stream_rate_concurrent=1e9,
    platform=d.platform,
    device_kind=d.device_kind,
    hostname=socket.gethostname(),
    jax_version=jax.__version__,
  )


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.delenv(calibration.ENV_OVERRIDE, raising=False)
  return tmp_path


def test_dict_roundtrip():
  c = this_machine()
  assert Calibration.from_dict(c.to_dict()) == c
  assert Calibration.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_cache_roundtrip_is_keyed(cache_home):
  c = this_machine()
  path = calibration.save(c)
  assert path.parent == cache_home / "jax_dos" and c.key in path.name
  assert calibration.load_cached(c.key) == c
  assert calibration.load_cached() == c  # this machine's key
  other = dataclasses.replace(c, hostname="elsewhere")
  assert calibration.load_cached(other.key) is None
  calibration.save(other)
  assert calibration.load_cached() == c and calibration.load_cached(other.key) == other
  # calibrate() reads the cache instead of measuring.
  assert calibration.calibrate() == c


def test_damaged_cache_is_ignored(cache_home):
  path = calibration.cache_path()
  path.parent.mkdir(parents=True)
  path.write_text("{not json")
  assert calibration.load_cached() is None


def test_overrides(cache_home, monkeypatch):
  c = this_machine(h=3e9)
  assert calibration.get_calibration(c.to_dict()) == c
  path = cache_home / "mine.json"
  path.write_text(json.dumps(c.to_dict()))
  assert calibration.get_calibration(str(path)) == c
  monkeypatch.setenv(calibration.ENV_OVERRIDE, str(path))
  assert calibration.get_calibration() == c
  # Only the three solo rates are required; concurrency defaults to "the paths add up".
  small = Calibration.from_dict({"host_rate": 1.0, "stream_rate": 2.0, "device_rate": 3.0})
  assert small.host_rate_concurrent == 1.0 and small.stream_rate_concurrent == 2.0


def test_bad_overrides_are_explained(cache_home):
  with pytest.raises(ValueError, match="unknown Calibration fields"):
    calibration.as_calibration({"host_rate": 1.0, "stream_rate": 1.0, "device_rate": 1.0, "hots_rate": 2.0})
  with pytest.raises(ValueError, match="needs at least"):
    calibration.as_calibration({"host_rate": 1.0})
  with pytest.raises(FileNotFoundError, match="does not exist"):
    calibration.as_calibration(str(cache_home / "missing.json"))
  with pytest.raises(TypeError, match="Calibration, a dict or a JSON path"):
    calibration.as_calibration(3.0)


def test_calibrate_measures(cache_home):
  c = calibration.calibrate(size=2048, force=True, cache=True, reps=1)
  rates = [getattr(c, f) for f in cost_model._RATE_FIELDS]
  times = [getattr(c, f) for f in cost_model._TIME_FIELDS]
  assert all(math.isfinite(r) and r > 0 for r in rates)
  assert all(math.isfinite(t) and t >= 0 for t in times)
  assert c.size == 2048
  assert (c.device_free_bytes is None) == (jax.default_backend() == "cpu")  # the CPU backend has no memory stats
  assert c.key == calibration.current_key()
  assert calibration.load_cached() == c


def test_a_measurement_on_the_cpu_leaves_no_pinned_pool_behind(cache_home):
  """Only a measurement on an accelerator grows XLA's pinned pool (the overlapped step then keeps its state there)."""
  calibration.calibrate(size=2048, force=True, cache=False, reps=1)
  assert calibration.measured_in_this_process() == (jax.default_backend() != "cpu")


def test_a_measurement_on_an_accelerator_says_where_the_step_will_keep_its_state(cache_home, monkeypatch, caplog):
  """On an accelerator the measurement's pinned state stays in XLA's pool: a note says what that means for an
  overlapped step made in this process, and the flag ``pinned_memory="auto"`` reads is set."""
  monkeypatch.setattr(calibration, "measure", lambda **kw: this_machine())
  monkeypatch.setattr(calibration.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(calibration, "_measured_here", False)
  with caplog.at_level(logging.INFO, logger="jax_dos"):
    calibration.calibrate(force=True, cache=False)
  assert calibration.measured_in_this_process()
  assert any("keeps its state in that pool" in r.getMessage() for r in caplog.records)


def test_the_measuring_notice_is_information(cache_home, monkeypatch):
  """Logged at INFO, so a library user sees nothing unless the application shows jax_dos's notes (train.gpt does)."""
  monkeypatch.setattr(calibration, "measure", lambda **kw: this_machine())
  records: list[logging.LogRecord] = []
  handler = logging.Handler(logging.DEBUG)
  handler.emit = records.append
  logger = logging.getLogger("jax_dos")
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    calibration.calibrate()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  notices = [r for r in records if "measuring this machine" in r.getMessage()]
  assert len(notices) == 1 and notices[0].levelno == logging.INFO
  assert all(r.levelno < logging.WARNING for r in records)
