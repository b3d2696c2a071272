"""What a new user of ``python -m train.gpt`` reads when a command line is wrong, and on its progress line."""

from __future__ import annotations

import jax
import pytest

from train import flags as F
from train import progress as P


def test_an_argparse_error_is_its_line_and_the_help_hint(capsys):
  with pytest.raises(SystemExit) as exit_:
    F.parse_args(["--stepz", "3"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err.splitlines()
  assert err == ["python -m train.gpt: error: unrecognized arguments: --stepz 3",
                 "(python -m train.gpt --help lists the flags)"]  # fmt: skip
  with pytest.raises(SystemExit):
    F.parse_args(["--lr", "0"])
  assert capsys.readouterr().err.splitlines()[0] == "python -m train.gpt: error: --lr must be > 0, got 0.0."


@pytest.mark.skipif(jax.device_count() != 1 or jax.default_backend() != "cpu", reason="one CPU device")
def test_a_mesh_larger_than_the_cpus_devices_names_devices(capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.raises(SystemExit):
    F.parse_args(["--mesh", "data=3"])
  assert "or --devices 3: on a CPU it makes 3 CPU devices." in capsys.readouterr().err


def test_the_progress_line_shows_no_validation_loss_before_the_first_pass():
  row = {"loss": 2.5, "mfu": None}
  assert "val" not in P.bar_fields(row, "1:00", {0: 5.5})  # step 0's, the starting model's, is not repeated
  assert P.bar_fields(row, "1:00", {0: 5.5, 10: 3.25})["val"] == "3.250"
  assert "val" not in P.bar_fields(row, "1:00", {})
