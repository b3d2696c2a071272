"""Runs a Python module with its threads' stacks sampled: where a long phase without output spends its time.

    python bench/tools/stack_sampler.py --every 3 --after 60 -- -m train.gpt --preset gpt-2.7b ...

From ``--after`` seconds on, every ``--every`` seconds, one line on stderr per
thread that is in Python code: ``stack <seconds> <thread name>: file:line
function < ...`` (innermost first, ``--depth`` frames), the thread's running
frames as ``sys._current_frames`` shows them: the main thread's always, another
thread's where its stack matches ``--match`` (a regex; default every thread). Lines of the same stack in a row
are printed once, with the count of the samples they stood for, so a log holds
the phases rather than every sample. The module runs as ``python -m`` would run
it (``runpy``), in this process.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import threading
import time


def _stack(frame, depth: int) -> str:
  parts = []
  while frame is not None and len(parts) < depth:
    code = frame.f_code
    parts.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
    frame = frame.f_back
  return " < ".join(parts)


def _sample(every: float, after: float, depth: int, match: re.Pattern, t0: float) -> None:
  time.sleep(after)
  last: dict[int, tuple[str, int]] = {}
  me = threading.get_ident()
  while True:
    names = {t.ident: t.name for t in threading.enumerate()}
    now = time.perf_counter() - t0
    for ident, frame in sys._current_frames().items():
      if ident == me:
        continue
      stack = _stack(frame, depth)
      if ident != threading.main_thread().ident and not match.search(stack):
        continue
      seen, count = last.get(ident, ("", 0))
      if stack == seen:
        last[ident] = (stack, count + 1)
        continue
      if count > 1:
        print(f"stack {now:8.1f} {names.get(ident, ident)}: (the stack above, {count} samples)", file=sys.stderr)
      print(f"stack {now:8.1f} {names.get(ident, ident)}: {stack}", file=sys.stderr, flush=True)
      last[ident] = (stack, 1)
    time.sleep(every)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--every", type=float, default=2.0, help="seconds between samples")
  p.add_argument("--after", type=float, default=0.0, help="seconds before the first sample")
  p.add_argument("--depth", type=int, default=8, help="frames a stack shows, innermost first")
  p.add_argument("--match", default="", help="regex: the other threads whose stacks are shown (default all)")
  p.add_argument("rest", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS...")
  args = p.parse_args()
  rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
  if len(rest) < 2 or rest[0] != "-m":
    p.error("give the module to run: -- -m MODULE [ARGS...]")
  sample = (args.every, args.after, args.depth, re.compile(args.match), time.perf_counter())
  sampler = threading.Thread(target=_sample, args=sample, name="stack_sampler", daemon=True)
  sampler.start()
  sys.argv = [rest[1], *rest[2:]]
  runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
