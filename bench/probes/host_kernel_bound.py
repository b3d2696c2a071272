"""Probe: what bounds the host kernels (float32, bfloat16, int8 moments) on a machine's cores.

Run on the GPU machine's host (the GPU is not used), from the repository's root::

    PYTHONPATH=$PWD OUT=$OUT python bench/probes/host_kernel_bound.py [--elements 268435456] [--threads 1 2 4 8 16]

Prints what it measures and writes ``$OUT/host_kernel_bound.json`` (or ``bench/results/`` without ``$OUT``):

- ``cpu``: ``lscpu``'s model, caches and vector flags (avx*, fma); llvmlite's host CPU name and the features numba
  compiles for.
- ``asm``: for each format's kernel, its innermost vector loops (one for each set of flags the kernel has a loop
  for; int8's first pass, then its second): their instructions (``body``), the vector registers they name (``zmm``:
  512-bit lanes, ``ymm``: 256-bit) and their divides, square roots and 32-bit multiplies by width. A loop takes
  one vector of lanes an iteration (int8's first pass two): 3 divides and 1 square root a vector are the weight's.
- ``stream``: a numba triad ``a = b + s c`` and copy ``a = b`` over ``--stream-elements`` float32 each (1 GiB an
  array by default) at each thread count, in GB/s counted as STREAM counts (12 and 8 B an element; a store's
  read-for-ownership not counted).
- ``rows``: at each thread count and ``--elements`` parameters, each format's kernel and its *traffic twin*: a loop
  with the same loads and stores (g, p, m, v read; p, m, v written in place) and no arithmetic to speak of. The twin's
  rate is what the DRAM (or a core's memory concurrency) allows the kernel's bytes; a kernel near its twin is bound by
  memory, one far below it by its arithmetic (the row of one thread: a core's). Beside them the *variants*, the same
  bits by other code (``variants_same_bits`` checks): ``bfloat16_spans`` (spans of 256 elements, the hash inputs an
  induction), ``bfloat16_prefetch`` (the same, each span first prefetching the lines 8 spans on, towards L2),
  ``int8_codes`` (``host_compact``'s split before: all seven divides and square roots in the second pass),
  ``int8_weights_first`` (the weights in the first pass), ``int8_prefetch`` (the kernel, each block first
  prefetching the lines 4 blocks on), ``bfloat16_prefetch_far`` and ``int8_prefetch_far`` (32 spans, 16 blocks
  on), and the ``_reciprocal`` variants of each format (the weight's two divides by the step's constants
  ``1 - b**t`` as a multiply and two fused multiply-adds, Markstein's correction: ``_div_by``).
- ``core``: one thread, each kernel, variant and twin at ``--core-elements`` (in cache: the arithmetic's rate a
  core), best of ``--core-repeats``, a launch's fixed cost (a call on 256 elements) taken off.
- ``hot``: all the threads at once, each on its own ``--hot-per-thread`` elements (in its core's cache), best of
  ``--core-repeats``, a launch's cost (256 elements a thread) taken off: the cores' arithmetic together, at the
  clocks all of them busy allow and sharing whatever a core's threads share. No memory system lets a kernel run
  faster than this over DRAM.

Rates are G parameters/s (``n / time``), the best of ``--repeats`` calls after one warm-up (which compiles). Each
kernel feeds on its own output, as ``bench/host_kernel.py``'s do. Kernels compile into a fresh cache (``asm`` needs
code compiled in the process); thread counts left after ``--budget-s`` seconds are skipped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="host_kernel_bound_"))  # before numba: asm
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # moment_formats imports jax; no accelerator needed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import host_kernel_variants as hkv  # noqa: E402  (after NUMBA_CACHE_DIR: its kernels compile there)
import llvmlite.binding as llvm  # noqa: E402
import numba  # noqa: E402
import numba.extending  # noqa: E402
import numpy as np  # noqa: E402

from jax_dos.core import moment_formats as mf  # noqa: E402
from jax_dos.kernels import host_compact, host_kernels  # noqa: E402
from jax_dos.planning.cost_model import kernel_bytes  # noqa: E402

F = np.float32
HYPER = (F(0.9), F(0.1), F(0.999), F(0.001), F(1e-8), F(0), F(0))  # b1, 1 - b1, b2, 1 - b2, eps, eps_root, wd
STEP = (F(-1e-3), F(0.65), F(0.01), F(1))  # -lr, 1 - b1**t, 1 - b2**t, gradient scale
FORMATS = ("float32", "bfloat16", "int8")
BYTES = {fmt: kernel_bytes(fmt) for fmt in FORMATS}  # DRAM bytes a parameter: 28, 20, about 16
_OPTS = dict(parallel=True, nogil=True, boundscheck=False)


# ----------------------------------------------------------------------------- machine


def cpu_info() -> dict:
  """lscpu's model, caches and vector flags; the CPU and features numba's LLVM compiles for."""
  try:
    text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError) as e:
    text = f"lscpu failed: {e}"
  fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  flags = fields.get("Flags", "").split()
  vector = sorted(f for f in flags if re.match(r"^(avx|fma|sse4|amx|f16c)", f))
  keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU max MHz", "CPU MHz",
          "L1d cache", "L2 cache", "L3 cache", "NUMA node(s)", "Hypervisor vendor")  # fmt: skip
  features = llvm.get_host_cpu_features()
  on = sorted(k for k, v in features.items() if v) if hasattr(features, "items") else str(features)
  return dict(
    lscpu={k: fields[k] for k in keep if k in fields},
    vector_flags=vector,
    avx512=[f for f in vector if f.startswith("avx512")],
    llvm_host_cpu=llvm.get_host_cpu_name(),
    numba_cpu_name=numba.config.CPU_NAME or "host",
    numba_cpu_features=numba.config.CPU_FEATURES or "host",
    llvm_host_features=[f for f in on if re.match(r"^(avx|fma|sse4|prefer|amx|evex)", f)],
    numba=numba.__version__,
    numba_threads=numba.config.NUMBA_NUM_THREADS,
    python=sys.version.split()[0],
  )


# ----------------------------------------------------------------------------- buffers and kernels


@numba.njit(**_OPTS)
def _fill(g, p, m, v):  # deterministic values of Adam's sizes: |g|, |p| < 1, m ~ g / 10, v ~ g**2 / 100
  for i in numba.prange(g.shape[0]):
    h = mf.nb_hash(i, np.uint32(12345))
    x = np.float32(np.int32(h >> np.uint32(8))) * np.float32(2.0**-24) - np.float32(0.5)
    g[i], p[i], m[i], v[i] = x, np.float32(0.5) - x, np.float32(0.1) * x, np.float32(0.01) * x * x + np.float32(1e-6)


@numba.njit(**_OPTS)
def _codes(src, key, out):  # random code bytes
  for i in numba.prange(out.shape[0]):
    out[i] = np.uint8(mf.nb_hash(i, np.uint32(key)) >> np.uint32(24)) | np.uint8(src)


@numba.njit(**_OPTS)
def _to_bf16_bits(x, out):
  for i in numba.prange(x.shape[0]):
    out[i] = np.uint16(np.float32(x[i]).view(np.uint32) >> np.uint32(16))


def buffers(n: int) -> dict:
  """g, p, m, v (float32), the moments as bfloat16 bits and as int8 blocks (codes, then unit scales)."""
  g, p, m, v = (np.empty(n, F) for _ in range(4))
  _fill(g, p, m, v)
  mb, vb = np.empty(n, np.uint16), np.empty(n, np.uint16)
  _to_bf16_bits(m, mb)
  _to_bf16_bits(v, vb)
  nb = mf.blocks(n)
  m8, v8 = (np.zeros(nb * (mf.BLOCK + 4), np.uint8) for _ in range(2))
  _codes(0, 1, m8[:n])
  _codes(1, 2, v8[:n])  # nu codes >= 1
  for buf in (m8, v8):
    buf[nb * mf.BLOCK :].view(F)[:] = 1.0
  return dict(g=g, p=p, m=m, v=v, mb=mb, vb=vb, m8=m8, v8=v8)


@numba.njit(**_OPTS)
def _twin_f32(g, p, m, v, zero, one):  # float32's loads and stores, no arithmetic to speak of
  for i in numba.prange(g.shape[0]):
    p[i] = p[i] + zero * g[i]
    m[i] = m[i] * one
    v[i] = v[i] * one


@numba.njit(**_OPTS)
def _twin_16(g, p, m, v, zero, key):  # bfloat16's (16-bit moments)
  for i in numba.prange(g.shape[0]):
    p[i] = p[i] + zero * g[i]
    m[i] = m[i] ^ key
    v[i] = v[i] ^ key


@numba.njit(**_OPTS)
def _twin_8(g, p, m, v, zero, key):  # int8's (byte codes; the scales, 4 B a block, not touched)
  for i in numba.prange(g.shape[0]):
    p[i] = p[i] + zero * g[i]
    m[i] = m[i] ^ key
    v[i] = v[i] ^ key


# ----------------------------------------------------------------------------- variants (host_kernel_variants.py)

_BF16_SPANS, _BF16_PREFETCH = hkv.make_bf16_spans(0), hkv.make_bf16_spans(8)  # 8 spans: 8 KB of g and of p ahead
_INT8_WEIGHTS_FIRST, _INT8_PREFETCH = hkv.make_int8(True, 0), hkv.make_int8(False, 4)
_BF16_RECIPROCAL, _INT8_RECIPROCAL = (
  hkv.make_bf16_spans(0, hkv.weight_reciprocal),
  hkv.make_int8(False, 0, hkv.weight_reciprocal),
)
_BF16_PREFETCH_FAR, _INT8_PREFETCH_FAR = hkv.make_bf16_spans(32), hkv.make_int8(False, 16)  # 32 KB and 64 KB of g ahead
_INT8_CODES = host_compact.make_int8_kernel(host_kernels._load_f32, host_kernels._bf16_bits, roots_first=False)
VARIANTS = ("float32_reciprocal", "bfloat16_spans", "bfloat16_prefetch", "bfloat16_prefetch_far", "bfloat16_reciprocal",
            "int8_codes", "int8_weights_first", "int8_prefetch", "int8_prefetch_far", "int8_reciprocal")  # fmt: skip


def calls(b: dict) -> dict:
  """Each format's kernel (``host_kernels``' dispatch: state written, no bfloat16 copy) and twin, as callables."""
  g, p, m, v, mb, vb, m8, v8 = (b[k] for k in ("g", "p", "m", "v", "mb", "vb", "m8", "v8"))
  low = np.zeros(0, np.uint16)
  keys = (mf.host_key(11.0, 0), mf.host_key(11.0, 1))
  k32 = host_kernels._KERNELS["float32", "bfloat16"]
  kb = host_kernels._COMPACT["bfloat16", "float32", "bfloat16"]
  ki = host_kernels._COMPACT["int8", "float32", "bfloat16"]
  (mc, mw), (vc, vw) = host_compact.int8_views(m8), host_compact.int8_views(v8)
  n = g.shape[0]
  z, one, k0 = F(0), F(1), np.uint16(0)
  return {
    "float32": lambda: k32(
      g, p, m, v, low, low, low, *HYPER, *STEP, False, False, False, F(0), F(1), F(1), True, False
    ),
    "bfloat16": lambda: kb(g, p, mb, vb, p, mb, vb, low, *HYPER, *STEP, *keys, False, False, True),
    "int8": lambda: ki(g, p, mc, mw, vc, vw, p, mc, mw, vc, vw, low, *HYPER, *STEP, *keys, False, False, True),
    # The variants: the same bits as the kernel of their format (checked), other code.
    "float32_reciprocal": lambda: hkv.f32_reciprocal(g, p, m, v, *HYPER, *STEP),
    "bfloat16_spans": lambda: _BF16_SPANS(g, p, mb, vb, *HYPER, *STEP, *keys),
    "bfloat16_reciprocal": lambda: _BF16_RECIPROCAL(g, p, mb, vb, *HYPER, *STEP, *keys),
    "bfloat16_prefetch_far": lambda: _BF16_PREFETCH_FAR(g, p, mb, vb, *HYPER, *STEP, *keys),
    "bfloat16_prefetch": lambda: _BF16_PREFETCH(g, p, mb, vb, *HYPER, *STEP, *keys),
    "int8_codes": lambda: _INT8_CODES(
      g, p, mc, mw, vc, vw, p, mc, mw, vc, vw, low, *HYPER, *STEP, *keys, False, False, True
    ),
    "int8_weights_first": lambda: _INT8_WEIGHTS_FIRST(g, p, mc, mw, vc, vw, *HYPER, *STEP, *keys),
    "int8_prefetch": lambda: _INT8_PREFETCH(g, p, mc, mw, vc, vw, *HYPER, *STEP, *keys),
    "int8_reciprocal": lambda: _INT8_RECIPROCAL(g, p, mc, mw, vc, vw, *HYPER, *STEP, *keys),
    "int8_prefetch_far": lambda: _INT8_PREFETCH_FAR(g, p, mc, mw, vc, vw, *HYPER, *STEP, *keys),
    "twin_float32": lambda: _twin_f32(g, p, m, v, z, one),
    "twin_bfloat16": lambda: _twin_16(g, p, mb, vb, z, k0),
    "twin_int8": lambda: _twin_8(g, p, mc[:n], vc[:n], z, np.uint8(0)),
  }


# ----------------------------------------------------------------------------- timing


def best(fn, repeats: int, clock=time.perf_counter) -> float:
  fn()  # warm-up (compiles on first use)
  out = float("inf")
  for _ in range(repeats):
    t0 = clock()
    fn()
    out = min(out, clock() - t0)
  return out


@numba.njit(**_OPTS)
def _triad(a, b, c, s):
  for i in numba.prange(a.shape[0]):
    a[i] = b[i] + s * c[i]


@numba.njit(**_OPTS)
def _copy(a, b):
  for i in numba.prange(a.shape[0]):
    a[i] = b[i]


def stream(n: int, threads: list[int], repeats: int) -> list[dict]:
  a, b, c = np.empty(n, F), np.empty(n, F), np.empty(n, F)
  numba.set_num_threads(max(threads))
  _fill(a, b, c, a)  # first touch by all threads
  rows = []
  for t in threads:
    numba.set_num_threads(t)
    tt = best(lambda: _triad(a, b, c, F(0.5)), repeats)
    tc = best(lambda: _copy(a, b), repeats)
    rows.append(dict(threads=t, triad_GBps=12 * n / tt / 1e9, copy_GBps=8 * n / tc / 1e9))
    print(f"stream  threads {t:3d}: triad {rows[-1]['triad_GBps']:7.1f} GB/s, copy {rows[-1]['copy_GBps']:7.1f} GB/s",
          flush=True)  # fmt: skip
  return rows


def sweep(fns: dict, n: int, threads: list[int], repeats: int, deadline: float) -> list[dict]:
  rows = []
  for t in threads:
    if time.perf_counter() > deadline:
      print(f"kernels threads {t:3d}: skipped (past --budget-s)", flush=True)
      continue
    numba.set_num_threads(t)
    row = dict(threads=t)
    for name, fn in fns.items():
      s = best(fn, repeats)
      row[f"{name}_Gps"] = n / s / 1e9
      row[f"{name}_GBps"] = n * BYTES[name.removeprefix("twin_").split("_")[0]] / s / 1e9
    for fmt in FORMATS:
      row[f"{fmt}_of_twin"] = row[f"{fmt}_Gps"] / row[f"twin_{fmt}_Gps"]
      row[f"{fmt}_vs_float32"] = row[f"{fmt}_Gps"] / row["float32_Gps"]
    rows.append(row)
    print(f"kernels threads {t:3d}: " + ", ".join(f"{f} {row[f'{f}_Gps']:.3f} ({row[f'{f}_GBps']:.0f} GB/s, twin "
          f"{row[f'twin_{f}_Gps']:.3f})" for f in FORMATS) + " G params/s; " + ", ".join(
          f"{v} {row[f'{v}_Gps']:.3f}" for v in VARIANTS), flush=True)  # fmt: skip
  return rows


def core(small: dict, n_small: int, repeats: int) -> dict:
  """One thread, in cache: each kernel's arithmetic a core, a launch's fixed cost (a call on 256 elements) taken
  off (the same thread's rate over ``--elements`` is ``rows``' first row)."""
  numba.set_num_threads(1)
  tiny = calls(buffers(256))
  out = {}
  for name in small:
    launch = best(tiny[name], repeats)
    t_small = best(small[name], repeats)
    out[name] = dict(in_cache_Gps=n_small / max(t_small - launch, 1e-9) / 1e9, launch_us=launch * 1e6)
    print(f"core    {name:18s}: in cache {out[name]['in_cache_Gps']:.3f} G params/s (launch {launch * 1e6:.0f} us)",
          flush=True)  # fmt: skip
  return out


def hot(per_thread: int, threads: int, repeats: int) -> dict:
  """All ``threads`` at once in cache (module docstring): each kernel's rate with every core busy."""
  numba.set_num_threads(threads)
  n = per_thread * threads
  fns, tiny = calls(buffers(n)), calls(buffers(256 * threads))
  out = {}
  for name in fns:
    launch = best(tiny[name], repeats)
    t = best(fns[name], repeats)
    net = n / (t - launch) / 1e9 if t > 2 * launch else None  # None: the launch too large a part to take off
    out[name] = dict(in_cache_Gps=net, raw_Gps=n / t / 1e9, launch_us=launch * 1e6)
    print(f"hot     {name:18s}: {threads} threads in cache {net or float('nan'):.3f} G params/s (raw "
          f"{out[name]['raw_Gps']:.3f}, launch {launch * 1e6:.0f} us)", flush=True)  # fmt: skip
  return dict(threads=threads, per_thread=per_thread, kernels=out)


def check_variants(n: int = 3 * mf.BLOCK + 37) -> dict:
  """Each variant's state after two steps against its format's kernel's, byte for byte (True: the same bits)."""
  out = {}
  for variant in VARIANTS:
    fmt = variant.split("_")[0]
    state = {"float32": ("p", "m", "v"), "bfloat16": ("p", "mb", "vb"), "int8": ("p", "m8", "v8")}[fmt]
    a, b = buffers(n), buffers(n)
    for bufs in (a, b):
      bufs["v"][:5] = 0.0  # zeros among the moments
      bufs["g"][7] = np.nan
      bufs["m"][9:40] *= np.exp2(np.arange(-140, -109, dtype=F))  # tiny moments: the reciprocal's scaled range
      bufs["g"][9:40] *= np.exp2(np.arange(-140, -109, dtype=F))
    fa, fb = calls(a), calls(b)
    for _ in range(2):
      fa[fmt]()
      fb[variant]()
    out[variant] = all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in state)
  print(f"same bits: {out}", flush=True)
  return out


# ----------------------------------------------------------------------------- code


def hot_loops(asm: str) -> list[dict]:
  """The innermost loops (a backward branch's body holding no other) of at least 10 vector instructions, each with
  its instructions, the vector registers they name (zmm: 512-bit lanes, ymm: 256) and its divides, square roots and
  32-bit integer multiplies by width (a vector of float32 lanes takes 3 divides and 1 square root in the weight)."""
  labels, ins = {}, []
  for line in asm.splitlines():
    s = line.split("#")[0].strip()
    lab = re.match(r"^(\.LBB\w+):", s)
    if lab:
      labels[lab.group(1)] = len(ins)
    elif s and not s.startswith("."):
      ins.append(s)
  loops = set()
  for i, s in enumerate(ins):
    jump = re.match(r"^j\w+\s+(\.LBB\w+)$", s)
    if jump and labels.get(jump.group(1), i + 1) <= i:
      loops.add((labels[jump.group(1)], i))
  inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
  width = lambda x: "zmm" if "zmm" in x else "ymm" if "ymm" in x else "xmm"  # noqa: E731
  out = []
  for a, b in sorted(inner):
    body = ins[a : b + 1]
    regs = {r: sum(r in x for x in body) for r in ("zmm", "ymm", "xmm")}
    if regs["zmm"] + regs["ymm"] < 10:
      continue
    heavy = collections.Counter(f"{x.split()[0]}.{width(x)}" for x in body if re.match(r"^v(div|sqrt)[ps]s|^vpmull", x))
    out.append(dict(body=body, instructions=len(body), registers=regs, divides_roots_multiplies=dict(heavy),
                    top_ops=dict(collections.Counter(x.split()[0] for x in body).most_common(10))))  # fmt: skip
  return out


def code_of(fns: dict) -> dict:
  out = {}
  for name, fn in (("float32", fns["float32"]), ("bfloat16", fns["bfloat16"]), ("int8", fns["int8"])):
    kernel = {"float32": host_kernels._KERNELS["float32", "bfloat16"],
              "bfloat16": host_kernels._COMPACT["bfloat16", "float32", "bfloat16"],
              "int8": host_kernels._COMPACT["int8", "float32", "bfloat16"]}[name]  # fmt: skip
    fn()
    try:
      asm = kernel.inspect_asm(kernel.signatures[0])
      out[name] = dict(whole=dict(zmm=asm.count("zmm"), ymm=asm.count("ymm")), loops=hot_loops(asm))
    except Exception as e:  # code loaded from a cache cannot be inspected
      out[name] = dict(error=repr(e))
    brief = [{k: v for k, v in loop.items() if k in ("instructions", "registers", "divides_roots_multiplies")}
             for loop in out[name].get("loops", [])]  # fmt: skip
    print(f"asm     {name:9s}: {out[name].get('error') or brief}", flush=True)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--elements", type=int, default=256 * 2**20)
  ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--stream-elements", type=int, default=2**28)
  ap.add_argument("--core-elements", type=int, default=2**18)
  ap.add_argument("--core-repeats", type=int, default=20)
  ap.add_argument("--hot-per-thread", type=int, default=2**15, help="elements a thread in the hot rows; 0: none")
  ap.add_argument("--budget-s", type=float, default=200, help="skip the thread counts left after this many seconds")
  args = ap.parse_args()
  threads = [t for t in args.threads if t <= numba.config.NUMBA_NUM_THREADS]
  t0 = time.perf_counter()
  result = dict(probe="host_kernel_bound", elements=args.elements, threads=threads, bytes_per_param=BYTES)
  result["cpu"] = cpu_info()
  print(json.dumps(result["cpu"], indent=1), flush=True)
  result["threading_layer_requested"] = numba.config.THREADING_LAYER
  small = calls(buffers(args.core_elements))
  result["asm"] = code_of(small)
  result["variants_same_bits"] = check_variants()
  result["threading_layer"] = numba.threading_layer()
  result["stream"] = stream(args.stream_elements, threads, args.repeats)
  numba.set_num_threads(max(threads))
  large = calls(buffers(args.elements))
  result["rows"] = sweep(large, args.elements, threads, args.repeats, t0 + args.budget_s)
  del large
  result["core"] = core(small, args.core_elements, args.core_repeats)
  if args.hot_per_thread:
    result["hot"] = hot(args.hot_per_thread, max(threads), args.core_repeats)
  result["seconds"] = time.perf_counter() - t0
  print(f"done in {result['seconds']:.0f} s", flush=True)
  out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(__file__)), "results")
  with open(os.path.join(out, "host_kernel_bound.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
