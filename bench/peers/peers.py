"""One peer of jax-dos training ``models/gpt.py``'s GPT (in torch) on one GPU: tokens/s, MFU, split, memory, loss.

Systems (one per process):

  ``zero2``    DeepSpeed ZeRO-2, ``offload_optimizer: {device: cpu, pin_memory: true}`` (ZeRO-Offload: fp32 master
               and Adam state on the host, ``DeepSpeedCPUAdam``);
  ``zero3``    DeepSpeed ZeRO-3 with ``offload_optimizer.ratio`` (TwinFlow: the last ``ratio`` of the sub-groups of
               ``sub_group_size`` elements on the host, the others on the GPU);
  ``torchao``  torchao's ``CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)`` in a plain torch loop;
  ``torch``    ``torch.optim.AdamW`` with everything on the device (where it fits; runs on the CPU too).

DeepSpeed runs without a launcher: a one-process ``torch.distributed`` group through MASTER_ADDR/MASTER_PORT/RANK/
WORLD_SIZE, then ``deepspeed.initialize``. All systems use the AdamW of ``bench/train_step.py`` (lr 1e-5 constant,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices and embeddings only, global-norm clip 1.0), a bf16 model
with per-block activation checkpointing, and ``--batch`` x ``--grad-accum`` sequences of ``--seq-len`` random tokens
per step. The *same* batch is repeated every step (seeded), so the loss must fall: ``loss_fell`` says whether the
last step's loss is below the first's.

Per step: wall time, tokens/s, and the forward / backward / optimizer split (``torch.cuda.synchronize`` around each
call: the engine's forward, ``engine.backward``, ``engine.step``; for torch and torchao, ``loss.backward`` and the
clip + ``optimizer.step`` + ``zero_grad``). Per run: MFU against a bf16 matmul peak measured in this process (or
``--peak-tflops``), peak GPU memory (allocated and reserved), peak host RSS (``VmHWM``) and the machine's peak host
use (sampled ``MemTotal - MemAvailable``). Before anything is allocated the host memory the system needs is
estimated (``host_memory.py``) and a setup that the machine cannot hold is refused (exit status 3, the reason in the
JSON).

Usage (GPU machine, DeepSpeed and torchao installed as bench/peers/README.md says)::

    python bench/peers/peers.py --system zero2 --preset gpt-6.7b --batch 16 --grad-accum 1 --out $OUT/zero2.json
    python bench/peers/peers.py --system zero3 --preset gpt-6.7b --batch 8 --grad-accum 2 --out $OUT/zero3.json
    python bench/peers/peers.py --system torchao --preset gpt-6.7b --batch 8 --grad-accum 2 --out $OUT/torchao.json
    python bench/peers/peers.py --system torch --smoke --out /tmp/torch.json     # tiny model, CPU is fine
    OMP_NUM_THREADS=16 torchrun --standalone --nproc-per-node 2 bench/peers/peers.py --system zero2 --batch 16 \
      --grad-accum 1 --out $OUT/zero2_2gpu.json   # one process a GPU: --batch is a GPU's; rank r > 0 writes
                                                  # zero2_2gpu.rank<r>.json

``torchrun`` sets ``OMP_NUM_THREADS=1`` in each process unless the environment sets it, and DeepSpeed's CPU Adam then
runs on one core: give each process its share of the cores (measured on two H100s, 32 cores: 2,601 tokens/s a GPU
with one thread, 5,833 with 16; ``bench/results/scaling-h100x2/``).

Without a GPU, ``zero2`` and ``zero3`` run on DeepSpeed's CPU accelerator (gloo): for smoke tests only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import host_memory  # noqa: E402

GIB = 2**30
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-5, (0.9, 0.95), 1e-8, 0.1, 1.0  # bench/train_step.py's AdamW
EXIT_REFUSED = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--system", required=True, choices=host_memory.SYSTEMS)
  p.add_argument("--preset", default="gpt-6.7b")
  p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
  p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--vocab-size", type=int, default=50304, help="as bench/train_step.py")
  p.add_argument("--steps", type=int, default=3, help="timed steps")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
  p.add_argument("--lr", type=float, default=LR)
  p.add_argument("--no-remat", action="store_true", help="keep block activations (default: recompute)")
  p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: measured here)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", required=True, help="JSON file")
  g = p.add_argument_group("DeepSpeed")
  g.add_argument("--ratio", type=float, default=0.75, help="zero3: offload_optimizer.ratio")
  g.add_argument("--sub-group-size", type=float, default=2.5e8, help="zero3: sub_group_size")
  g.add_argument("--ds-config", default=None, help="JSON merged into the DeepSpeed config (e.g. bucket sizes)")
  g.add_argument("--host-fallback", action="store_true",
                 help="zero2: if B x G does not fit in host memory, run (B*G) x 1 (same tokens per step)")  # fmt: skip
  g = p.add_argument_group("torchao")
  g.add_argument("--torchao-master", default="bf16", choices=("bf16", "fp32"),
                 help="bf16: a bf16 model, AdamW state in bf16 on the host (torchao's advice); fp32: an fp32 model"
                      " under bf16 autocast, fp32 master and state on the host (the others' arithmetic)")  # fmt: skip
  g.add_argument("--torchao-clip", default="none", choices=("none", "host"),
                 help="none: as torchao (no clip); host: global norm, host gradients scaled before step")  # fmt: skip
  g.add_argument("--offload-gradients", default="auto", choices=("auto", "on", "off"),
                 help="torchao: free GPU gradients once copied (auto: on without accumulation)")  # fmt: skip
  p.add_argument("--skip-host-check", action="store_true", help="run even if the estimate says it does not fit")
  p.add_argument("--smoke", action="store_true", help="tiny model, short sequences (CPU is fine but for torchao)")
  args = p.parse_args(argv)
  if args.smoke:
    args.preset, args.batch, args.seq_len, args.vocab_size, args.steps, args.warmup = "tiny", 2, 64, 256, 2, 1
  for name in ("batch", "grad_accum", "seq_len", "vocab_size", "steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if args.warmup < 0:
    p.error(f"--warmup must be >= 0, got {args.warmup}.")
  if args.offload_gradients == "on" and args.grad_accum > 1:
    p.error("--offload-gradients on frees the GPU gradients after every backward: it cannot accumulate; use off.")
  return args


# ----------------------------------------------------------------------------- measurements


class HostSampler:
  """Samples this process's RSS and the machine's used memory (``MemTotal - MemAvailable``) in a thread."""

  def __init__(self, period_s: float = 0.25):
    self.period_s, self.rss_peak, self.used_peak = period_s, 0, 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  @staticmethod
  def _kib(path: str, key: str) -> int:
    with open(path) as f:
      for line in f:
        if line.startswith(key + ":"):
          return int(line.split()[1]) * 1024
    return 0

  def sample(self) -> None:
    self.rss_peak = max(self.rss_peak, self._kib("/proc/self/status", "VmRSS"))
    used = self._kib("/proc/meminfo", "MemTotal") - self._kib("/proc/meminfo", "MemAvailable")
    self.used_peak = max(self.used_peak, used)

  def _run(self) -> None:
    while not self._stop.wait(self.period_s):
      self.sample()

  def __enter__(self) -> HostSampler:
    self.sample()
    self._thread.start()
    return self

  def __exit__(self, *exc: object) -> None:
    self._stop.set()
    self._thread.join()
    self.sample()

  def result(self) -> dict[str, int]:
    return {
      "host_rss_peak_bytes": max(self.rss_peak, self._kib("/proc/self/status", "VmHWM")),
      "host_used_peak_bytes": self.used_peak,
    }


def measure_peak(torch: Any, device: Any) -> dict[str, Any]:
  """bf16 matmul FLOP/s of this GPU, as bench/train_step.py's ``peak`` variant (best of 4096, 8192, 16384)."""
  best = {}
  for n in (4096, 8192, 16384):
    a = torch.ones((n, n), dtype=torch.bfloat16, device=device)
    for _ in range(2):
      a @ a
    times = []
    for _ in range(5):
      torch.cuda.synchronize()
      t = time.perf_counter()
      a @ a
      torch.cuda.synchronize()
      times.append(time.perf_counter() - t)
    best[str(n)] = 2 * n**3 / statistics.median(times)
    del a
  torch.cuda.empty_cache()
  torch.cuda.reset_peak_memory_stats(device)  # the model's peak, not the matmul's
  return {"peak_flops": max(best.values()), "peak_by_size": best}


class Timer:
  """Wall time of a call, with the device synchronized before and after."""

  def __init__(self, sync: Any):
    self.sync = sync

  def __call__(self, fn: Any, *a: Any) -> tuple[Any, float]:
    self.sync()
    t = time.perf_counter()
    out = fn(*a)
    self.sync()
    return out, time.perf_counter() - t


# ----------------------------------------------------------------------------- systems


class TorchRunner:
  """Plain torch: loss.backward per micro-batch (scaled by 1/G), then clip, ``optimizer.step``, ``zero_grad``."""

  def __init__(self, torch: Any, model: Any, optimizer: Any, grad_accum: int, clip: Any, autocast: bool):
    self.torch, self.model, self.optimizer, self.grad_accum = torch, model, optimizer, grad_accum
    self.clip, self.autocast, self.clip_s = clip, autocast, 0.0

  def forward(self, x: Any, y: Any) -> Any:
    with self.torch.autocast(x.device.type, dtype=self.torch.bfloat16, enabled=self.autocast):
      return self.model(x, y)

  def backward(self, loss: Any) -> None:
    (loss / self.grad_accum).backward()

  def step(self, last: bool) -> None:
    if not last:
      return
    t = time.perf_counter()
    self.clip()
    self.clip_s = time.perf_counter() - t
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)


class DeepSpeedRunner:
  """DeepSpeed's engine: ``engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` after every micro-batch."""

  def __init__(self, engine: Any):
    self.engine, self.clip_s = engine, 0.0

  def forward(self, x: Any, y: Any) -> Any:
    return self.engine(x, y)

  def backward(self, loss: Any) -> None:
    self.engine.backward(loss)

  def step(self, last: bool) -> None:
    self.engine.step()


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
  """ZeRO-2 with the optimizer on the host, or ZeRO-3 with a ``ratio`` of it there; AdamW as train_step's."""
  offload = {"device": "cpu", "pin_memory": True}
  if args.system == "zero2":
    zero = {"stage": 2, "offload_optimizer": offload}
  else:
    zero = {
      "stage": 3,
      "offload_optimizer": {**offload, "ratio": args.ratio},
      "sub_group_size": int(args.sub_group_size),
    }
  config = {
    "train_micro_batch_size_per_gpu": args.batch,
    "gradient_accumulation_steps": args.grad_accum,
    "gradient_clipping": CLIP,
    "bf16": {"enabled": True},
    "zero_optimization": zero,
    "optimizer": {
      "type": "AdamW",
      "params": {"lr": args.lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
    },
    "steps_per_print": 2**30,
    "wall_clock_breakdown": False,
  }
  return merge(config, json.loads(args.ds_config)) if args.ds_config else config


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
  """``base`` with ``extra`` merged in, nested dicts key by key."""
  out = dict(base)
  for k, v in extra.items():
    out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def local_ranks() -> int:
  """Processes of this job on this host (``torchrun --nproc-per-node``'s ``LOCAL_WORLD_SIZE``; 1 alone)."""
  return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def init_distributed() -> None:
  """A one-process ``torch.distributed`` group on this machine, as a launcher would set it up."""
  if "MASTER_PORT" not in os.environ:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      os.environ["MASTER_PORT"] = str(s.getsockname()[1])
  for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(key, value)


def make_deepspeed(args: argparse.Namespace, torch: Any, model: Any, out: dict[str, Any]) -> DeepSpeedRunner:
  import logging

  import deepspeed
  import torch_gpt
  from deepspeed.ops.op_builder import CPUAdamBuilder
  from deepspeed.utils import logger

  logger.setLevel(logging.WARNING)
  out["deepspeed"] = deepspeed.__version__
  t = time.perf_counter()
  CPUAdamBuilder().load(verbose=False)  # JIT build on first use (1-2 min), cached in TORCH_EXTENSIONS_DIR
  out["cpu_adam_load_s"] = time.perf_counter() - t
  print(f"cpu_adam ready in {out['cpu_adam_load_s']:.1f} s", flush=True)
  init_distributed()
  backend = "nccl" if torch.cuda.is_available() else "gloo"  # gloo: DeepSpeed's CPU accelerator (smoke tests)
  deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
  if args.system == "zero3":  # the tied head reads wte.weight outside the embedding's forward
    deepspeed.zero.register_external_parameter(model, model.wte.weight)
  config = deepspeed_config(args)
  out["ds_config"] = config
  engine, *_ = deepspeed.initialize(
    model=model, model_parameters=torch_gpt.param_groups(model, WEIGHT_DECAY), config=config
  )
  return DeepSpeedRunner(engine)


def make_torchao(args: argparse.Namespace, torch: Any, model: Any, out: dict[str, Any]) -> TorchRunner:
  import torch_gpt
  import torchao
  from torchao.optim import CPUOffloadOptimizer

  offload_gradients = args.offload_gradients == "on" or (args.offload_gradients == "auto" and args.grad_accum == 1)
  out.update(torchao=torchao.__version__, offload_gradients=offload_gradients)
  groups = torch_gpt.param_groups(model, WEIGHT_DECAY)
  optimizer = CPUOffloadOptimizer(
    groups, torch.optim.AdamW, offload_gradients=offload_gradients, fused=True, lr=args.lr, betas=BETAS, eps=EPS
  )
  clip = (lambda: torchao_clip(torch, optimizer, CLIP)) if args.torchao_clip == "host" else (lambda: None)
  return TorchRunner(torch, model, optimizer, args.grad_accum, clip, autocast=args.torchao_master == "fp32")


def torchao_clip(torch: Any, optimizer: Any, max_norm: float) -> float:
  """Global-norm clip of a ``CPUOffloadOptimizer``'s gradients before its step; returns the norm.

  torchao copies each gradient to its pinned host copy in a post-accumulate-grad hook, during the backward pass,
  and steps each parameter's own AdamW on that copy: clipping the GPU gradients after the backward pass would not
  reach the host (torchao's README: "Gradient clipping is currently not supported"). So the norm is taken (torch's
  ``get_total_norm``) from the GPU gradients where they are kept (no ``offload_gradients``), else from the host
  copies once their copies are done, and the host copies and the small parameters' GPU gradients (those stay on the
  GPU) are scaled in place (``clip_grads_with_norm_``). Uses the optimizer's ``queue``, ``param_d2h_map`` and
  ``d_param_groups``.
  """
  for event in optimizer.queue.values():
    event.synchronize()
  offloaded = list(optimizer.queue)
  holders = [optimizer.param_d2h_map[p] for p in offloaded]  # host copies: .grad is the host gradient
  small = [p for group in optimizer.d_param_groups for p in group["params"] if p.grad is not None]
  kept = offloaded if all(p.grad is not None for p in offloaded) else holders
  norm = torch.nn.utils.get_total_norm([p.grad for p in kept + small])
  if float(norm) > max_norm:
    torch.nn.utils.clip_grads_with_norm_(holders + small, max_norm, norm)
  return float(norm)


def make_torch(args: argparse.Namespace, torch: Any, model: Any, device: Any) -> TorchRunner:
  import torch_gpt

  fused = device.type == "cuda"
  optimizer = torch.optim.AdamW(
    torch_gpt.param_groups(model, WEIGHT_DECAY), lr=args.lr, betas=BETAS, eps=EPS, fused=fused
  )  # fmt: skip
  clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
  return TorchRunner(torch, model, optimizer, args.grad_accum, clip, autocast=False)


# ----------------------------------------------------------------------------- the run


def model_config(args: argparse.Namespace, on_gpu: bool) -> Any:
  from models import gpt

  fp32_master = args.system == "torchao" and args.torchao_master == "fp32"
  compute = "bfloat16" if on_gpu or args.system in ("zero2", "zero3") else "float32"  # DeepSpeed's bf16 engine
  return gpt.get_config(
    args.preset,
    vocab_size=args.vocab_size,
    block_size=max(args.seq_len, gpt.PRESETS[args.preset]["block_size"]),
    dtype=compute,
    param_dtype="float32" if fp32_master else compute,
    remat=not args.no_remat,
  )


def host_check(args: argparse.Namespace, cfg: Any, limit: int) -> dict[str, Any]:
  """Estimates the host memory against ``limit`` bytes; may turn zero2's B x G into (B*G) x 1 (``--host-fallback``).

  With ``--host-fallback``, where B x G does not fit and (B*G) x 1 does, ``args`` is changed to the latter.
  Returns the record for the JSON; ``record["refused"]`` holds the message when the run must not start.
  """
  shapes = host_memory.param_shapes(cfg)
  itemsize = 4 if cfg.param_dtype == "float32" else 2
  ranks = local_ranks()
  limit //= ranks  # the host's processes share it

  def need(grad_accum: int) -> int:
    return host_memory.estimate(args.system, shapes, grad_accum=grad_accum, ratio=args.ratio, itemsize=itemsize,
                                ranks=ranks)  # fmt: skip

  record = {"host_estimate_bytes": need(args.grad_accum), "host_limit_bytes": limit, "local_ranks": ranks}
  message = host_memory.refusal(
    args.system, record["host_estimate_bytes"], limit, host_memory.hint(args.system, args.batch, args.grad_accum)
  )
  if message and args.system == "zero2" and args.host_fallback and args.grad_accum > 1:
    if host_memory.refusal(args.system, need(1), limit, "") is None:
      print(f"{message}\n-> running {args.batch * args.grad_accum} x 1 instead (--host-fallback).", flush=True)
      record["layout_changed_from"] = [args.batch, args.grad_accum]
      args.batch, args.grad_accum = args.batch * args.grad_accum, 1
      record["host_estimate_bytes"], message = need(1), None
  if message and not args.skip_host_check:
    record["refused"] = message
  return record


def run(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
  import torch
  import torch_gpt

  from models import gpt

  on_gpu = torch.cuda.is_available()
  if args.system == "torchao" and not on_gpu:
    raise SystemExit("--system torchao needs a CUDA GPU (CPUOffloadOptimizer supports CUDA and XPU only).")
  device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
  sync = torch.cuda.synchronize if on_gpu else (lambda: None)
  torch.set_float32_matmul_precision("high")  # float32 matmuls (the head) in TF32, as XLA's default on a GPU
  if on_gpu:
    torch.cuda.set_device(device)
  out.update(torch=torch.__version__, device=torch.cuda.get_device_name(device) if on_gpu else platform.processor(),
             cpu_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"))  # fmt: skip

  if on_gpu and args.peak_tflops is None:
    out.update(measure_peak(torch, device))
  elif args.peak_tflops is not None:
    out["peak_flops"] = args.peak_tflops * 1e12

  cfg = model_config(args, on_gpu)
  t0 = time.perf_counter()
  torch.manual_seed(args.seed)
  with torch.device(device):
    model = torch_gpt.TorchGPT(cfg)
  out.update(
    model=cfg.to_dict(),
    num_params=torch_gpt.count_params(model),
    flops_per_token=gpt.flops_per_token(cfg, args.seq_len),
  )
  if args.system in ("zero2", "zero3"):
    runner = make_deepspeed(args, torch, model, out)
  elif args.system == "torchao":
    runner = make_torchao(args, torch, model, out)
  else:
    runner = make_torch(args, torch, model, device)
  sync()
  out["init_s"] = time.perf_counter() - t0
  print(f"{args.system}: {out['num_params']:,} parameters ready in {out['init_s']:.1f} s", flush=True)

  gen = torch.Generator().manual_seed(args.seed)
  tokens = torch.randint(0, cfg.vocab_size, (args.grad_accum, args.batch, args.seq_len + 1), generator=gen)
  tokens = tokens.to(device)
  micro = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(args.grad_accum)]  # the same batch every step
  timer = Timer(sync)
  steps = []
  for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    row = {"fwd_s": 0.0, "bwd_s": 0.0, "opt_s": 0.0, "losses": []}
    for j, (x, y) in enumerate(micro):
      loss, dt = timer(runner.forward, x, y)
      row["fwd_s"] += dt
      row["losses"].append(float(loss.detach()))
      _, dt = timer(runner.backward, loss)
      row["bwd_s"] += dt
      _, dt = timer(runner.step, j == len(micro) - 1)
      row["opt_s"] += dt
    row.update(
      step_s=time.perf_counter() - t, loss=statistics.fmean(row["losses"]), clip_s=runner.clip_s, warmup=i < args.warmup
    )
    row["tokens_per_s"] = args.batch * args.grad_accum * args.seq_len / row["step_s"]
    steps.append(row)
    save(args.out, {**out, "steps": steps, "cut_short": True})  # a run stopped at a deadline keeps what it measured
    print(
      f"step {i + 1}/{args.warmup + args.steps}{' (warm-up)' if row['warmup'] else ''}: loss {row['loss']:.4f},"
      f" {row['step_s']:.2f} s (fwd {row['fwd_s']:.2f}, bwd {row['bwd_s']:.2f}, opt {row['opt_s']:.2f}),"
      f" {row['tokens_per_s']:,.0f} tok/s",
      flush=True,
    )

  timed = [s for s in steps if not s["warmup"]]
  med = {k: statistics.median(s[k] for s in timed) for k in ("step_s", "fwd_s", "bwd_s", "opt_s", "clip_s")}
  tokens_per_step = args.batch * args.grad_accum * args.seq_len
  losses = [s["loss"] for s in steps]
  out.update(
    tokens_per_step=tokens_per_step,
    steps=steps,
    **med,
    tokens_per_s=tokens_per_step / med["step_s"],  # this process's GPU's
    ranks=int(os.environ.get("WORLD_SIZE", "1")),
    losses=losses,
    loss_fell=losses[-1] < losses[0],
  )
  if out.get("peak_flops"):
    out["mfu"] = out["flops_per_token"] * out["tokens_per_s"] / out["peak_flops"]
  if on_gpu:
    out.update(
      gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
      gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
    )
  return out


def save(path: str, out: dict[str, Any]) -> None:
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


def main(argv: list[str] | None = None) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # models.gpt imports jax: keep it off the GPU torch uses
  args = parse_args(argv)
  if int(os.environ.get("RANK", "0")):  # a launcher's other ranks: each its own JSON beside rank 0's
    args.out = f"{os.path.splitext(args.out)[0]}.rank{os.environ['RANK']}.json"
  out: dict[str, Any] = {"system": args.system, "host": socket.gethostname(), "python": platform.python_version()}
  out["command"] = " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  cfg = model_config(args, on_gpu=True)
  out.update(host_check(args, cfg, host_memory.read_host_limit()))
  out["config"] = vars(args)
  if "refused" in out:
    print(f"refused: {out['refused']}", flush=True)
    save(args.out, out)
    return EXIT_REFUSED
  print(
    f"host memory: about {out['host_estimate_bytes'] / GIB:.1f} GiB needed of {out['host_limit_bytes'] / GIB:.1f}",
    flush=True,
  )
  status = 0
  try:
    with HostSampler() as sampler:
      run(args, out)
  except BaseException as e:  # the JSON says what failed, then the error propagates as the exit status
    out["error"] = f"{type(e).__name__}: {e}"
    out["traceback"] = traceback.format_exc()[-4000:]
    status = 1
  out.update(sampler.result())
  out["host_bytes_per_param"] = out["host_rss_peak_bytes"] / out["num_params"] if out.get("num_params") else None
  save(args.out, out)
  if status:
    print(out["traceback"], file=sys.stderr, flush=True)
    return status
  mfu = f", MFU {100 * out['mfu']:.1f}%" if "mfu" in out else ""
  gpu = f", GPU peak {out['gpu_peak_allocated_bytes'] / GIB:.1f} GiB" if "gpu_peak_allocated_bytes" in out else ""
  print(
    f"{args.system}: {out['tokens_per_s']:,.0f} tok/s{mfu}{gpu},"
    f" host RSS peak {out['host_rss_peak_bytes'] / GIB:.1f} GiB;"
    f" loss {out['losses'][0]:.4f} -> {out['losses'][-1]:.4f} ({'falls' if out['loss_fell'] else 'DOES NOT FALL'})",
    flush=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
