"""Runs a command as a user would and records what its end and its host memory look like from outside.

    python bench/tools/run_timed.py --json OUT.json --log OUT.log --mark 'done: step' -- python -m train.gpt ...

Each line the command prints (stdout and stderr together; a progress bar's
carriage returns end a line too) goes to ``--log`` behind the seconds since
the start. ``--json`` gets: the exit status, the wall time, when the last
line matching ``--mark`` came, how long the process took to end after it
(``exit_after_mark_s``), and the peak resident set of the command's process
tree and the peak of the machine's used memory, sampled every 0.5 s
(``psutil``), with what the peak held (read again at each new peak 1 % above
the last one read): the command's resident set by mapping
(``peak_rss_by_mapping``, from ``/proc/PID/smaps``: each file or device by
name, anonymous memory by mapping size, and each anonymous mapping of 1 GiB
or more with its kernel flags), and the resident set's course (``rss_series``: ``[seconds, GiB]`` every
``--series-every-s``, on the log's clock, so a phase's peak can be read beside its lines). ``--deadline-s``
stops the command there (SIGINT, then SIGKILL 30 s later) and records ``stopped_at_deadline``, so that a run
sized to a time limit still leaves its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import threading
import time

import psutil


def _tree_rss(proc: psutil.Process) -> int:
  try:
    procs = [proc, *proc.children(recursive=True)]
  except psutil.Error:
    return 0
  total = 0
  for p in procs:
    try:
      total += p.memory_info().rss
    except psutil.Error:
      pass
  return total


def _rss_by_mapping(pid: int, top: int = 12) -> dict:
  """What a process's resident memory is, from ``/proc/PID/smaps``: ``gib``, GiB grouped (a mapped file or device by
  its path, anonymous memory as ``[anon >=1GiB]``, ``[anon 64MiB-1GiB]`` or ``[anon <64MiB]`` by the mapping's size,
  the heap and stacks by name), and ``large_anon``, each anonymous mapping of 1 GiB or more (its range, size, resident
  GiB and kernel flags: who made it shows in them, e.g. ``lo`` locked, ``dd`` not dumped)."""
  groups: dict[str, int] = {}
  large: list[dict] = []
  name, size, current = "", 0, None
  try:
    with open(f"/proc/{pid}/smaps") as f:
      for line in f:
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms offset dev inode [path]
          lo, hi = (int(x, 16) for x in head.split("-"))
          parts = line.split(None, 5)
          name, size = (parts[5].strip() if len(parts) > 5 else ""), hi - lo
          current = None
          if not name:
            name = "[anon >=1GiB]" if size >= 2**30 else "[anon 64MiB-1GiB]" if size >= 2**26 else "[anon <64MiB]"
            if size >= 2**30:
              current = {"range": head, "perms": parts[1], "size_gib": round(size / 2**30, 3)}
              large.append(current)
        elif head == "Rss:":
          rss = int(line.split()[1]) * 1024
          groups[name] = groups.get(name, 0) + rss
          if current is not None:
            current["rss_gib"] = round(rss / 2**30, 3)
        elif head == "VmFlags:" and current is not None:
          current["flags"] = line.split(None, 1)[1].strip()
  except (OSError, ValueError):
    return {}
  biggest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
  return {
    "gib": {k: round(v / 2**30, 3) for k, v in biggest if v >= 2**24},
    "large_anon": sorted(large, key=lambda m: -m.get("rss_gib", 0))[:16],
  }


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--json", required=True)
  p.add_argument("--log", required=True)
  p.add_argument("--mark", default="done: step", help="regex of the line after which the process should end")
  p.add_argument("--deadline-s", type=float, default=None, help="stop the command after this many seconds")
  p.add_argument("--series-every-s", type=float, default=2.0, help="the resident set's course: a sample this often")
  p.add_argument("command", nargs=argparse.REMAINDER)
  args = p.parse_args()
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  mark = re.compile(args.mark)
  t0 = time.perf_counter()
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  # SIGINT handled, not ignored, so that the command starts with it at its default and its Python installs the
  # KeyboardInterrupt that the deadline's SIGINT raises: an ignored SIGINT is inherited through exec (a background
  # job of a non-interactive shell, a test runner's worker), and the command then outlived the deadline by 30 s.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
  marked: list[float] = []

  def read() -> None:  # this thread alone writes the log and ``marked``
    with open(args.log, "w") as log:
      for raw in iter(lambda: proc.stdout.readline(), b""):
        for piece in re.split(rb"\r", raw.rstrip(b"\n")):
          if not piece.strip():
            continue
          line = piece.decode(errors="replace")
          now = time.perf_counter() - t0
          log.write(f"{now:9.2f} {line}\n")
          log.flush()
          if mark.search(line):
            marked.append(now)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  peak_rss = peak_used = 0
  ps = psutil.Process(proc.pid)
  stopped_at = None
  breakdown: dict = {}
  breakdown_rss = 0.0
  series: list[list[float]] = []

  def write(wall: float) -> dict:  # the JSON as it stands (written again at the end)
    row = {
      "command": command,
      "returncode": proc.returncode,
      "wall_s": wall,
      "mark_s": marked[-1] if marked else None,
      "exit_after_mark_s": wall - marked[-1] if marked and proc.returncode is not None else None,
      "stopped_at_deadline": stopped_at,
      "peak_rss_gib": peak_rss / 2**30,
      "peak_rss_by_mapping": {"at_rss_gib": breakdown_rss / 2**30, **breakdown},
      "peak_machine_used_gib": peak_used / 2**30,
      "machine_total_gib": psutil.virtual_memory().total / 2**30,
      "rss_series": series,
    }
    with open(args.json, "w") as f:
      json.dump(row, f, indent=1)
    return row

  while proc.poll() is None:
    rss = _tree_rss(ps)
    peak_rss = max(peak_rss, rss)
    if rss > breakdown_rss * 1.01 + 2**26:  # a new peak, 1 % above the last one read: what holds it
      breakdown = _rss_by_mapping(proc.pid) or breakdown
      breakdown_rss = rss
    peak_used = max(peak_used, psutil.virtual_memory().used)
    now = time.perf_counter() - t0
    if not series or now >= series[-1][0] + args.series_every_s:
      series.append([round(now, 2), round(rss / 2**30, 3)])
    if args.deadline_s is not None and now > args.deadline_s:
      if stopped_at is None:
        stopped_at = now
        write(now)  # a process holding much pinned memory can take minutes to end: what was seen is kept
        proc.send_signal(signal.SIGINT)
      elif now > stopped_at + 30:
        proc.kill()
    time.sleep(0.5)
  wall = time.perf_counter() - t0
  reader.join(timeout=10)
  print(json.dumps(write(wall)), flush=True)


if __name__ == "__main__":
  main()
