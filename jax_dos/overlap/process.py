"""What the overlapped step asks of its process: XLA's command buffers off, and its open steps closed at exit.

Several threads launch accelerator work at once in an overlapped step, and
XLA's GPU command buffers (CUDA graphs) fail a capture that another thread
launches into (``docs/measurements.md``): :func:`check_no_command_buffers`
refuses a GPU process that did not turn them off before jax started. A step
returns before its update is done and its workers are daemon threads, so
every open step is registered (:func:`register`) and settled and closed
before the interpreter finalizes (:func:`close_open_steps`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Any

import jax

# Several threads launch accelerator work at once here, and XLA's GPU command buffers (CUDA graphs) fail a capture that
# another thread launches into (docs/measurements.md). This flag, set before jax starts, turns them off.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
# How long the exit handler waits for an open step to settle before it leaves it (a worker stuck after a fault).
EXIT_SETTLE_S = 120.0


def check_no_command_buffers() -> None:
  flags = os.environ.get("XLA_FLAGS", "").split()
  if jax.default_backend() == "gpu" and NO_COMMAND_BUFFERS not in flags:
    raise RuntimeError(
      f"OverlappedStep on a GPU needs XLA's command buffers off: set XLA_FLAGS='{NO_COMMAND_BUFFERS}' (with any"
      " other flags) before jax starts. Its optimizer threads launch work while the training thread does, which"
      " fails a CUDA-graph capture. Or train on the plain path (jax_dos.update_params after jax.grad)."
    )


_OPEN_STEPS: weakref.WeakSet = weakref.WeakSet()  # steps not yet closed, settled when Python exits


def close_open_steps() -> None:
  """Settles and closes every open step before the interpreter finalizes.

  Its workers are daemon threads: left mid-update (a step returns before its
  update is done), they were stopped inside XLA's C++ code as Python shut
  down, and the process aborted. Each new step registers this exit handler
  again, so that it runs before the handlers JAX registered when its
  backends started (exit handlers run last registered first). A worker's
  error is not raised here: the program is ending. A step that has not
  settled within ``EXIT_SETTLE_S`` (a worker stuck after an accelerator
  fault) is left, said on stderr, so that the program ends instead of
  hanging.
  """
  for step in list(_OPEN_STEPS):
    closer = threading.Thread(target=_close_quietly, args=(step,), daemon=True)
    closer.start()
    closer.join(EXIT_SETTLE_S)
    if closer.is_alive():
      print(
        f"jax_dos: an OverlappedStep did not settle within {EXIT_SETTLE_S:g} s at exit (a worker is stuck, most"
        " likely after an accelerator fault); its last update is incomplete. Resume from the last checkpoint.",
        file=sys.stderr,
        flush=True,
      )
      return


def _close_quietly(step: Any) -> None:
  try:
    step.close()
  except Exception:  # noqa: BLE001
    pass


def register(step: Any) -> None:
  """Closes ``step`` at exit unless it is closed before (:func:`unregister`); registers the exit handler again, so that
  it runs before the handlers jax registered when its backends started (exit handlers run last registered first)."""
  _OPEN_STEPS.add(step)
  atexit.unregister(close_open_steps)
  atexit.register(close_open_steps)


def unregister(step: Any) -> None:
  """``step`` is closed: nothing to do for it at exit."""
  _OPEN_STEPS.discard(step)
