"""The training script's flags: ``python -m train.gpt --help``, parsed and checked.

:func:`parse_args` turns a command line into the ``argparse.Namespace`` the
script (and the benchmarks that mirror it) run from; every inconsistency is an
argparse error saying what to change.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import textwrap
from typing import Any

import jax

import jax_dos
from models import gpt as gpt_model
from models import hf
from models import llama as llama_model
from train import overlapped, parallel, progress

# The models --arch trains: each module has the same interface (models/lm.py).
ARCHS = {"gpt": gpt_model, "llama": llama_model}

OFFLOAD_MODES = ("none", "auto", "host", "stream", "device")

# Learning rate per preset when --lr is not given (smaller models tolerate larger steps).
DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "gpt2-124m": 6e-4, "gpt2-350m": 3e-4}
FALLBACK_LR = 2e-4
# Fine-tuning a pretrained model (--init-from), as common supervised fine-tuning recipes do (Llama 2's, Alpaca's):
# a small peak rate, a warm-up of 3 % of the steps, a cosine decay; sequences of at most 2048 tokens.
FINE_TUNE_LR = 2e-5
FINE_TUNE_WARMUP = 0.03
FINE_TUNE_SEQ_LEN = 2048
# The flags of the learning-rate schedule: a resumed run takes the checkpoint's values of those not given.
SCHEDULE_FLAGS = ("lr", "min_lr", "warmup", "decay_steps")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows ``(default: ...)`` only where there is a value to show (not for ``None`` or an off switch)."""

  def _get_help_string(self, action: argparse.Action) -> str:
    if action.default is None or action.default is False:
      return action.help or ""
    return super()._get_help_string(action)

  def _split_lines(self, text: str, width: int) -> list[str]:
    # Lines break between words only: a flag (--grad-flush) or a variable (JAX_NUM_PROCESSES) stays whole.
    return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def preset_names() -> list[str]:
  """Every architecture's presets, each name once (``tiny`` and ``small`` name one size in each), in their order."""
  return list(dict.fromkeys(name for module in ARCHS.values() for name in module.PRESETS))


def _lr_default_text() -> str:
  """Every preset's default --lr, presets sharing a value grouped: ``tiny 0.003, ..., gpt-1.3b/gpt-13b 0.0002``."""
  groups: dict[float, list[str]] = {}
  for name in preset_names():
    groups.setdefault(DEFAULT_LR.get(name, FALLBACK_LR), []).append(name)
  return ", ".join(f"{'/'.join(names)} {lr:g}" for lr, names in groups.items())


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m train.gpt",
    description="Train a GPT or a Llama-style model (Flax NNX) with jax_dos.interleaved_adam: AdamW whose state lives"
    " in host memory.",
    formatter_class=_HelpFormatter,
  )
  m = p.add_argument_group("model")
  m.add_argument("--arch", default=None, choices=tuple(ARCHS),
                 help="gpt (models/gpt.py: GPT-2; the default) or llama (models/llama.py: RMSNorm, rotary, SwiGLU,"
                      " grouped-query attention; the default with --init-from)")  # fmt: skip
  m.add_argument("--preset", default=None, choices=preset_names(),
                 help="model size (default tiny): gpt's " + ", ".join(gpt_model.PRESETS) + "; llama's "
                      + ", ".join(llama_model.PRESETS))  # fmt: skip
  m.add_argument("--init-from", default=None, metavar="DIR",
                 help="start from a Hugging Face checkpoint folder (config.json and model.safetensors or its shards):"
                      " Llama 2/3, Mistral or Qwen2/2.5, as --arch llama (models/hf.py); its config gives the model's"
                      " shape, and the defaults become fine-tuning's: --lr 2e-05, a warm-up of 0.03 x --steps,"
                      " --seq-len min(2048, the model's), --tokenizer DIR")  # fmt: skip
  m.add_argument("--n-layer", type=int, default=None, help="override the preset's number of blocks")
  m.add_argument("--n-head", type=int, default=None, help="override the preset's attention heads")
  m.add_argument("--d-model", type=int, default=None, help="override the preset's width")
  m.add_argument("--vocab-size", type=int, default=None,
                 help="default: the preset's (llama-1.1b, llama-7b: 32000), else 256 for byte data, 50304 for a .bin"
                      " file")  # fmt: skip
  m.add_argument("--param-dtype", choices=gpt_model.DTYPES, default=None,
                 help="parameter storage; default float32 for --offload none, bfloat16 otherwise")  # fmt: skip
  m.add_argument("--compute-dtype", choices=gpt_model.DTYPES, default=None,
                 help="default bfloat16 on a GPU, float32 otherwise")  # fmt: skip
  m.add_argument("--remat", nargs="?", const="full", default="auto", choices=overlapped.REMAT_MODES,
                 help="what each block's forward pass keeps for its backward pass (the flag alone: full): full"
                      " recomputes the block, minimal keeps the large matmuls' outputs and recomputes the rest, none"
                      " keeps everything, offload keeps those outputs in host memory; auto: the overlapped step's"
                      " plan chooses per block beside the optimizer state, from the measured stages and the memory"
                      " left (full where it is short), and the plain step takes full on an accelerator that reports"
                      " its memory, none elsewhere (docs/overlap.md)")  # fmt: skip

  d = p.add_argument_group("data")
  d.add_argument("--data", default=None,
                 help="a text file (read as bytes, or through the tokenizer where there is one), a nanoGPT uint16"
                      " .bin token file, or a .jsonl of {\"text\": ...} rows (packed, an end-of-sequence token after"
                      " each) or {\"prompt\": ..., \"completion\": ...} rows (the loss counts the completion's"
                      " tokens only); default: the Python standard library's sources")  # fmt: skip
  d.add_argument("--tokenizer", default=None, metavar="DIR",
                 help="a folder holding a Hugging Face tokenizer.json (the tokenizers library); default: the"
                      " --init-from folder; without one, text is read as bytes")  # fmt: skip
  d.add_argument("--batch", type=int, default=16,
                 help="sequences a device per micro-batch (per step without --grad-accum), as DeepSpeed's"
                      " train_micro_batch_size_per_gpu: a step takes batch x devices x grad-accum"
                      " sequences")  # fmt: skip
  d.add_argument("--seq-len", type=int, default=None, help="tokens per sequence; default: the preset's block size")

  o = p.add_argument_group("optimization")
  o.add_argument("--grad-accum", type=int, default=1,
                 help="micro-batches of --batch sequences per optimizer step, their gradients summed on the"
                      " accelerator (then crossing to the host in the update, as --grad-flush none)")  # fmt: skip
  o.add_argument("--steps", type=int, default=500, help="optimizer steps to train to (total, counting resumed ones)")
  o.add_argument("--lr", type=float, default=None, help=f"peak learning rate; default by preset: {_lr_default_text()}")
  o.add_argument("--min-lr", type=float, default=None, help="final learning rate of the cosine decay; default lr/10")
  o.add_argument("--warmup", type=int, default=None, help="linear warm-up steps; default min(100, steps/10)")
  o.add_argument("--decay-steps", type=int, default=None,
                 help="length of warm-up + cosine decay; default --steps (with --resume: the resumed run's, as for"
                      " --lr, --min-lr and --warmup)")  # fmt: skip
  o.add_argument("--beta1", type=float, default=0.9, help="AdamW's first-moment decay")
  o.add_argument("--beta2", type=float, default=0.95,
                 help="AdamW's second-moment decay: 0.95, the GPT-training convention, not optax's 0.999")  # fmt: skip
  o.add_argument("--weight-decay", type=float, default=0.1, help="decoupled, on matrices/embeddings only")
  o.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
  o.add_argument("--seed", type=int, default=0,
                 help="initial parameters and the batches' order (a resumed run must keep it)")  # fmt: skip

  x = p.add_argument_group("optimizer offload")
  x.add_argument("--offload", choices=OFFLOAD_MODES, default="auto",
                 help="none: optax.adamw on the accelerator; else jax_dos.interleaved_adam(plan=<mode>)")  # fmt: skip
  x.add_argument("--subgroup-size", type=int, default=jax_dos.DEFAULT_SUBGROUP_SIZE, help="elements per subgroup")
  x.add_argument("--resident-gb", type=float, default=None,
                 help="--offload auto: accelerator GiB for resident state (default: what the compiled"
                      " gradient step leaves free)")  # fmt: skip
  x.add_argument("--staging-gb", type=float, default=None,
                 help="--offload auto: GiB for streamed subgroups in flight (default: what the update phase"
                      " leaves free)")  # fmt: skip
  x.add_argument("--delay", type=int, choices=(0, 1), default=0,
                 help="1: host subgroups update one step late, overlapping the next forward/backward")  # fmt: skip
  x.add_argument(
    "--delay-warmup", type=int, default=jax_dos.DEFAULT_DELAY_WARMUP, help="normal steps before --delay 1 starts"
  )
  x.add_argument("--moments", choices=jax_dos.MOMENT_FORMATS, default="float32",
                 help="how AdamW's mu and nu are stored beside the float32 master: float32 (12 bytes of host state"
                      " a parameter), bfloat16 (8) or int8 (about 6; blocks of 256, a float32 scale each)")  # fmt: skip
  x.add_argument("--write-behind", action="store_true",
                 help="optax's exact numbers; host subgroups' state is written during the next step")  # fmt: skip
  x.add_argument("--delay-predict", nargs="?", const="moments", default=None, choices=jax_dos.DELAY_PREDICTIONS,
                 help="with --delay 1, gives the forward pass predicted weights instead of one-step-stale ones:"
                      " gradient (AdamW's own step, taken on the accelerator from state copies; 4 bytes a parameter"
                      " more host memory) or moments (the flag alone: an estimate from the moments, no memory)."
                      " Use gradient whenever you use --delay 1, since stale weights hurt convergence; moments"
                      " when host memory is short (docs/api.md)")  # fmt: skip
  x.add_argument("--overlap", choices=overlapped.OVERLAP_MODES, default="auto",
                 help="the overlapped step (AdamW under the backward and the next forward pass, same numbers): auto"
                      " (on a GPU, when the timeline model predicts a shorter step for the run: silent and fired"
                      " steps weighed by how often the clip fires), on, or off (docs/overlap.md)")  # fmt: skip
  x.add_argument("--pinned-memory", choices=("auto", "arena", "pool"), default="auto",
                 help="the overlapped step's offloaded state: in pinned memory it maps itself (arena: no table, given"
                      " back fast at exit) or in XLA's pinned pool (pool); auto: the arena, unless this process"
                      " measured the calibration (where measuring it in a process of its own failed) or restored a"
                      " state into the pool (--resume) (docs/overlap.md, \"Pinned memory of our own\")")  # fmt: skip
  x.add_argument("--grad-flush", choices=(*jax_dos.GRADIENT_FLUSHES, "none"), default=None,
                 help="where the backward pass leaves the gradients: host sends host-updated subgroups' ones to"
                      " host memory as it computes them (the default without --grad-accum), all sends every one,"
                      " none keeps them on the accelerator (the default with --grad-accum). Keep the default, and"
                      " switch to all (or none) when host is refused for lack of accelerator memory, as for large"
                      " models (6.7B)")  # fmt: skip

  j = p.add_argument_group("devices and processes")
  j.add_argument("--mesh", default=None,
                 help="lay every device of the job on a mesh, e.g. data=2 or data=2,fsdp=4: parameters replicated"
                      " over data (their optimizer state partitioned over it) and sharded over fsdp, batch rows over"
                      " both (--batch rows a device). Default: data=<all devices>, in one process all of this"
                      " host's GPUs (or in a job of several processes, jax.distributed: JAX_COORDINATOR_ADDRESS,"
                      " JAX_NUM_PROCESSES and JAX_PROCESS_ID, or SLURM, all of the job's)")  # fmt: skip
  j.add_argument("--devices", type=int, default=None,
                 help="train on this process's first K devices (default: all of them; CUDA_VISIBLE_DEVICES works"
                      " too); on a CPU, K CPU devices")  # fmt: skip

  r = p.add_argument_group("evaluation, logging, checkpoints")
  r.add_argument("--eval-every", type=int, default=100, help="steps between validation passes (0 = only at the end)")
  r.add_argument("--eval-batches", type=int, default=8, help="validation batches per pass")
  r.add_argument("--log-every", type=int, default=10, help="steps between metric rows / progress updates")
  r.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU; default: detected GPU")
  r.add_argument("--out", default=None, help="output directory; default runs/<preset>")
  r.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints (0 = only at the end)")
  r.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
  r.add_argument("--no-ckpt", action="store_true",
                 help="write no checkpoints (not even the final one); an earlier run's are left alone")  # fmt: skip
  r.add_argument("--resume", action="store_true",
                 help="continue from the newest checkpoint in <out>/ckpt that verifies (damaged ones are moved to"
                      " <out>/ckpt/damaged/)")  # fmt: skip
  r.add_argument("--overwrite", action="store_true", help="delete <out>/ckpt and the metrics of an earlier run")
  r.add_argument("--plot", action="store_true",
                 help="write <out>/loss.png at the end of the run (needs matplotlib: pip install -e '.[plot]');"
                      " python -m train.plot <out> plots a run's metrics.jsonl any time, without training")  # fmt: skip
  r.add_argument("--quiet", action="store_true", help="no progress bar or messages")
  r.add_argument("--profile", default=None, metavar="FIRST:STOP",
                 help="write a profile of steps FIRST to STOP-1 (as the log numbers them, from 1) to <out>/profile:"
                      " jax.profiler's trace, for TensorBoard's profile plugin or ui.perfetto.dev"
                      " (perfetto_trace.json.gz)")  # fmt: skip
  return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the flags; any inconsistency is an argparse error saying what to change.

  The default ``--compute-dtype`` depends on ``jax.default_backend()``, which starts jax's backend: set XLA's
  environment before calling this (``train.gpt.main`` does).
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  err = parser.error
  args.schedule_given = [name for name in SCHEDULE_FLAGS if getattr(args, name) is not None]  # before the defaults
  positive = ("batch", "grad_accum", "steps", "eval_batches", "log_every", "keep", "subgroup_size")
  for name in positive:
    if getattr(args, name) < 1:
      err(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  for name in ("eval_every", "ckpt_every", "clip", "weight_decay", "delay_warmup"):
    if getattr(args, name) < 0:
      err(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}.")
  for name in ("n_layer", "n_head", "d_model", "vocab_size"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      err(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if args.resume and args.no_ckpt:
    err("--resume continues from a checkpoint and saves more; drop --no-ckpt.")
  if args.init_from is not None:
    given = [f"--{name.replace('_', '-')}" for name in ("preset", "n_layer", "n_head", "d_model", "vocab_size")
             if getattr(args, name) is not None]  # fmt: skip
    if args.arch == "gpt" or given:
      err(f"--init-from takes the model from {args.init_from}/config.json (a Llama-family model, --arch llama);"
          f" drop {', '.join(given or ['--arch gpt'])}.")  # fmt: skip
    args.arch = "llama"
    try:
      block = model_config(args).block_size
    except hf.CheckpointError as e:
      err(f"--init-from {args.init_from}: {e}")
    args.seq_len = min(block, FINE_TUNE_SEQ_LEN) if args.seq_len is None else args.seq_len
    args.tokenizer = args.init_from if args.tokenizer is None else args.tokenizer
    args.lr = FINE_TUNE_LR if args.lr is None else args.lr
    if args.warmup is None:
      decay = args.steps if args.decay_steps is None else args.decay_steps
      args.warmup = min(decay - 1, max(1, round(FINE_TUNE_WARMUP * decay)))
    what = f"the model of {args.init_from}"
  else:
    args.arch, args.preset = args.arch or "gpt", args.preset or "tiny"
    presets = ARCHS[args.arch].PRESETS
    if args.preset not in presets:
      err(f"--preset {args.preset} is not a preset of --arch {args.arch}; choose one of {', '.join(presets)}.")
    shape = {**presets[args.preset], **model_overrides(args)}
    if shape["d_model"] % shape["n_head"]:
      err(f"--d-model {shape['d_model']} must be divisible by --n-head {shape['n_head']}.")
    try:
      ARCHS[args.arch].get_config(args.preset, **model_overrides(args))
    except ValueError as e:
      err(f"--arch {args.arch} --preset {args.preset} with these sizes: {e}")
    block = shape["block_size"]
    args.seq_len = block if args.seq_len is None else args.seq_len
    what = f"preset {args.preset!r}"
  if not 1 <= args.seq_len <= block:
    err(f"--seq-len {args.seq_len} must be between 1 and the block size of {what} ({block}).")
  args.lr = DEFAULT_LR.get(args.preset, FALLBACK_LR) if args.lr is None else args.lr
  if args.lr <= 0:
    err(f"--lr must be > 0, got {args.lr}.")
  args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
  if not 0 <= args.min_lr <= args.lr:
    err(f"--min-lr must be in [0, --lr={args.lr}], got {args.min_lr}.")
  args.decay_steps = args.steps if args.decay_steps is None else args.decay_steps
  args.warmup = min(100, args.decay_steps // 10) if args.warmup is None else args.warmup
  if not 0 <= args.warmup < args.decay_steps:
    err(f"--warmup must be in [0, --decay-steps={args.decay_steps}), got {args.warmup}.")
  for name in ("beta1", "beta2"):
    if not 0 <= getattr(args, name) < 1:
      err(f"--{name} must be in [0, 1), got {getattr(args, name)}.")
  if args.peak_flops is not None and args.peak_flops <= 0:
    err(f"--peak-flops must be > 0, got {args.peak_flops}.")
  if args.param_dtype is None:
    args.param_dtype = "float32" if args.offload == "none" else "bfloat16"
  if args.offload == "none" and args.param_dtype != "float32":
    err("--offload none trains float32 parameters with plain optax.adamw (no float32 master copy);"
        " use --param-dtype float32, or an offload mode for bfloat16 parameters.")  # fmt: skip
  if args.compute_dtype is None:
    args.compute_dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
  if args.delay and args.offload == "none":
    err("--delay 1 delays the host update of jax_dos; it needs an offload mode, not --offload none.")
  if args.write_behind and (args.delay or args.offload == "none"):
    err("--write-behind defers the host state's writes of an offload mode without --delay; drop one of them.")
  if args.grad_flush is None:
    args.grad_flush = "host" if args.grad_accum == 1 else "none"
  elif args.grad_accum > 1 and args.grad_flush != "none":
    err(f"--grad-accum {args.grad_accum} sums the gradients on the accelerator, so there is nothing to flush during"
        f" the backward pass; drop --grad-flush {args.grad_flush} (or use --grad-accum 1).")  # fmt: skip
  if args.moments != "float32" and args.offload == "none":
    err(f"--moments {args.moments} stores jax_dos's moments compactly; --offload none trains with optax.adamw. Pick"
        " an offload mode or drop --moments.")  # fmt: skip
  if args.moments != "float32" and args.delay_predict:
    err(f"--delay-predict works from float32 moments; drop it or use --moments float32 (not {args.moments}).")
  if args.delay_predict and not args.delay:
    err("--delay-predict predicts the weights a delayed update hands on; add --delay 1.")
  if args.overlap == "on" and overlapped.refusal(args):
    err(f"--overlap on: {overlapped.refusal(args)}; drop --overlap on.")
  if args.plot and importlib.util.find_spec("matplotlib") is None:
    err(f"--plot: {progress.MATPLOTLIB_MISSING} (or drop --plot, and plot later with python -m train.plot <out>).")
  if args.resume and args.overwrite:
    err("--resume and --overwrite contradict each other; pick one.")
  if args.profile is not None:
    try:
      first, stop = (int(x) for x in args.profile.split(":"))
    except ValueError:
      err(f"--profile {args.profile}: give FIRST:STOP, two step numbers, e.g. --profile 6:8 for steps 6 and 7.")
    if not 2 <= first < stop <= args.steps + 1:
      err(f"--profile {args.profile}: give 2 <= FIRST < STOP <= --steps + 1 = {args.steps + 1} (step 1 compiles,"
          " so a profile starts at step 2 or later).")  # fmt: skip
    args.profile = (first, stop)
  if args.devices is not None and args.devices > jax.local_device_count():
    err(f"--devices {args.devices}: this process has {jax.local_device_count()} device(s)"
        f" ({jax.devices()[0].device_kind}); give at most that.")  # fmt: skip
  args.mesh_given = args.mesh is not None
  try:
    args.mesh = parallel.parse_mesh(args.mesh) if args.mesh is not None else parallel.default_mesh()
  except ValueError as e:
    err(str(e))
  devices = 1
  if args.mesh is not None:
    devices = args.mesh["data"] * args.mesh["fsdp"]
    if devices != jax.device_count():
      err(f"--mesh data={args.mesh['data']},fsdp={args.mesh['fsdp']} lays out {devices} devices; this job has"
          f" {jax.device_count()} ({jax.process_count()} process(es) x {jax.local_device_count()}): give sizes whose"
          " product is that, or --devices to train on fewer.")  # fmt: skip
  args.global_batch = args.batch * devices  # rows of a micro-batch over every device
  if args.out is None:
    args.out = os.path.join("runs", model_name(args))
  return args


def model_name(args: argparse.Namespace) -> str:
  """A short name of the run's model: its preset (``llama-`` before a llama's shared one), or its checkpoint
  folder's name."""
  if args.init_from is not None:
    return os.path.basename(os.path.normpath(args.init_from))
  preset = args.preset or "tiny"
  arch = args.arch or "gpt"
  return preset if arch == "gpt" or preset.startswith(arch) else f"{arch}-{preset}"


def model_config(args: argparse.Namespace, **fields: Any) -> Any:
  """The run's model config from its flags (parsed or not: jax need not have started): ``--init-from``'s
  ``config.json`` (``models.hf``; ``hf.CheckpointError`` naming what it cannot express), else ``--arch``'s preset
  with the shape flags; ``fields`` set more (``vocab_size``, ``dtype``, ``param_dtype``, ``remat``)."""
  if getattr(args, "init_from", None) is not None:
    fields.pop("vocab_size", None)  # the checkpoint's own
    return hf.llama_config(hf.read_config(args.init_from), **fields)
  return model_module(args).get_config(args.preset or "tiny", **model_overrides(args), **fields)


def resumed_schedule(args: argparse.Namespace, saved_args: dict[str, Any]) -> list[str]:
  """Keeps the learning-rate schedule of the run being resumed; returns the lines to print (none if nothing changed).

  Each of ``--lr``, ``--min-lr``, ``--warmup`` and ``--decay-steps`` that this
  command line did not give (``args.schedule_given``, recorded by
  :func:`parse_args`) takes its value in ``saved_args`` (the ``args`` a
  checkpoint's meta holds), in place in ``args``: a larger ``--steps`` then
  trains on at the end of the same schedule instead of stretching it. A
  ``--min-lr`` not given follows a given ``--lr`` (its default, lr/10). Flags
  given are kept, and so is every flag when ``args`` has no
  ``schedule_given`` or ``saved_args`` lacks the value. Raises
  ``SystemExit`` naming the flags when the merged schedule is inconsistent.
  """
  given = set(getattr(args, "schedule_given", SCHEDULE_FLAGS))
  taken = {}
  for name in SCHEDULE_FLAGS:
    if name in given or (name == "min_lr" and "lr" in given) or saved_args.get(name) is None:
      continue
    if saved_args[name] != getattr(args, name):
      taken[name] = saved_args[name]
  if not taken:
    return []
  vars(args).update(taken)
  flags = ", ".join(f"--{name.replace('_', '-')}" for name in taken)
  if not 0 <= args.warmup < args.decay_steps or not 0 <= args.min_lr <= args.lr:
    raise SystemExit(
      f"error: --resume: the resumed run's {flags} and this command line's give a schedule of lr {args.lr:g} ->"
      f" {args.min_lr:g}, warm-up {args.warmup} of {args.decay_steps} steps; pass {flags} too."
    )
  return [
    f"resume: keeping the resumed run's learning-rate schedule ({flags} from its checkpoint): lr {args.lr:g} ->"
    f" {args.min_lr:g}, warm-up {args.warmup}, cosine to step {args.decay_steps}; pass {flags} to change it."
  ]


def model_module(args: argparse.Namespace):
  """The module of ``--arch``'s model (``models.gpt`` or ``models.llama``; ``llama`` with ``--init-from``)."""
  if getattr(args, "init_from", None) is not None:
    return llama_model
  return ARCHS[args.arch or "gpt"]


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
  """The model-shape flags that were given (they override the preset)."""
  return {k: getattr(args, k) for k in ("n_layer", "n_head", "d_model") if getattr(args, k) is not None}
