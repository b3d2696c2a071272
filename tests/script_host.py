"""One interpreter that runs the tests' scripts one after another, instead of one interpreter a script.

A test that needs a mesh of CPU devices runs its check in an interpreter started with that many devices (the count is
fixed when jax starts); a fresh interpreter for each such check paid jax's and the library's imports and the
backend's start each time. ``ScriptHost(4)`` starts one interpreter of 4 devices (``python tests/script_host.py``,
serving) that runs each script it is given in a namespace of its own, as ``python -c CODE ARGS...`` (or ``python
PATH ARGS...``) would, with the environment variables it is given, and answers with its exit status and what it
wrote to stdout and stderr; ``sys.argv``, ``sys.path``, ``os.environ`` and the working directory are restored after
each. The scripts share what they import and compile. A script that outlives its timeout ends the interpreter (the
next script starts another).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ScriptHost:
  """An interpreter of ``devices`` CPU devices (started at the first script) that runs scripts in turn; with
  ``devices=None``, of this process's environment as it is (its backend, its devices)."""

  def __init__(self, devices: int | None):
    self.devices = devices
    self._proc: subprocess.Popen | None = None
    self._answers: queue.Queue = queue.Queue()
    self._log = tempfile.TemporaryFile("w+")  # the interpreter's own stderr (native writes, its last words)

  def _start(self) -> subprocess.Popen:
    from helpers import cpu_devices_env

    env = dict(os.environ) if self.devices is None else cpu_devices_env(self.devices)
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=self._log, text=True)  # fmt: skip
    answers = self._answers = queue.Queue()
    threading.Thread(target=lambda: [answers.put(line) for line in proc.stdout] + [answers.put(None)],
                     daemon=True).start()  # fmt: skip
    return proc

  def run(self, code: str | None = None, *argv: str, path: str | None = None, env: dict | None = None,
          timeout: float = 600):  # fmt: skip
    """Runs ``code`` (or the file ``path``) with ``argv`` as its arguments, in ``ROOT``, the variables of ``env`` set
    in its environment; a ``subprocess.CompletedProcess`` (``returncode``, ``stdout``, ``stderr``), as
    ``subprocess.run`` would give."""
    if self._proc is None or self._proc.poll() is not None:
      self._proc = self._start()
    request = {"code": code, "path": path, "argv": list(argv), "env": env or {}}
    self._proc.stdin.write(json.dumps(request) + "\n")
    self._proc.stdin.flush()
    try:
      line = self._answers.get(timeout=timeout)
    except queue.Empty:
      line = None
    if line is None:  # it died or hung: ended, and what it said is the answer
      self.close()
      self._log.seek(0)
      said = self._log.read()[-6000:]
      return subprocess.CompletedProcess(argv, -9, "", f"the script host ended (timeout {timeout} s):\n{said}")
    answer = json.loads(line)
    return subprocess.CompletedProcess(argv, answer["code"], answer["stdout"], answer["stderr"])

  def close(self) -> None:
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait()
      self._proc = None


def _run_one(request: dict) -> dict:
  saved = (list(sys.argv), list(sys.path), dict(os.environ), os.getcwd())
  out, err, code = io.StringIO(), io.StringIO(), 0
  try:
    os.environ.update(request["env"])
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      if request["path"]:
        sys.argv = [request["path"], *request["argv"]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(request["path"])))
        runpy.run_path(request["path"], run_name="__main__")
      else:
        sys.argv = ["-c", *request["argv"]]
        sys.path.insert(0, "")
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, int) and e.code is not None:
      err.write(f"{e.code}\n")
  except BaseException:
    err.write(traceback.format_exc())
    code = 1
  finally:
    argv, path, environ, cwd = saved
    sys.argv, sys.path[:] = argv, path
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
  return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def serve() -> None:
  """Answers each request line of stdin (JSON: ``code`` or ``path``, ``argv``) with one line of JSON on the stdout
  it was started with; anything else written to file descriptor 1 goes to stderr."""
  answers = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
  for line in sys.stdin:
    answers.write(json.dumps(_run_one(json.loads(line))) + "\n")
    answers.flush()


if __name__ == "__main__":
  serve()
