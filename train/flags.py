"""The training script's flags: ``python -m train.gpt --help``, parsed and checked.

:func:`parse_args` turns a command line, parsed once, into the frozen
:class:`TrainConfig` the script (and the benchmarks that mirror it) run from;
every inconsistency is an argparse error saying what to change. No other
module sees argparse's ``Namespace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import textwrap
from collections.abc import Callable
from types import ModuleType
from typing import Any, NoReturn

import jax

import jax_dos
from models import gpt as gpt_model
from models import hf
from models import llama as llama_model
from train import overlapped, parallel, progress, stopping
from train.schedule import (
  DEFAULT_LR,
  FALLBACK_LR,
  FINE_TUNE_LR,
  FINE_TUNE_WARMUP,
  LARGE_MODEL,
  LARGE_WARMUP,
  SCHEDULE_FLAGS,
  lr_default_text,
)

# The models --arch trains: each module has the same interface (models/lm.py).
ARCHS = {"gpt": gpt_model, "llama": llama_model}

OFFLOAD_MODES = ("none", "auto", "host", "stream", "device")

FINE_TUNE_SEQ_LEN = 2048  # --init-from's longest sequence by default, as common fine-tuning recipes
SHAPE_FLAGS = ("n_layer", "n_head", "d_model")  # override the preset's
_Error = Callable[[str], NoReturn]  # the parser's error: the message, --help's hint and exit status 2


class Parser(argparse.ArgumentParser):
  """An ``argparse.ArgumentParser`` whose errors are one line and ``--help``'s hint, not the whole usage first (the
  training script's runs to 30 lines, above the line that matters)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the flags)\n")


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


def build_parser() -> argparse.ArgumentParser:
  p = Parser(
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
                      " .bin token file, or a .jsonl of {\"text\": ...} rows (an end-of-sequence token after each;"
                      " see --packing) or {\"prompt\": ..., \"completion\": ...} rows (the loss counts the completion's"
                      " tokens only); default: the Python standard library's sources")  # fmt: skip
  d.add_argument("--packing", choices=("rows", "stream"), default=None,
                 help="a .jsonl's rows as examples: rows (its default) packs them whole into sequences, each starting"
                      " at a row, the rows attending within themselves only and each placed from position 0, the"
                      " validation split the last tenth of the rows; stream packs them into one token stream cut into"
                      " windows, as a text file's (the validation split its last tenth of tokens)")  # fmt: skip
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
  o.add_argument(
    "--lr", type=float, default=None, help=f"peak learning rate; default by preset: {lr_default_text(preset_names())}"
  )
  o.add_argument("--min-lr", type=float, default=None, help="final learning rate of the cosine decay; default lr/10")
  o.add_argument("--warmup", type=int, default=None,
                 help=f"linear warm-up steps; default min(100, steps/10), or {LARGE_WARMUP} for a model of a billion"
                      " parameters or more (a run shorter than its warm-up ends with the rate still rising); with"
                      " --init-from"
                      f" {FINE_TUNE_WARMUP * 100:.0f} percent of the steps")  # fmt: skip
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
                      " steps weighed by how often the clip fires: a resumed run's record, else whether the first"
                      " batch's gradient norm exceeds --clip), on, or off (docs/overlap.md)")  # fmt: skip
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
  r.add_argument("--ckpt-every", type=int, default=0,
                 help="steps between checkpoints (0: none by steps), beside those by time and at the end")  # fmt: skip
  r.add_argument("--ckpt-every-minutes", type=float, default=stopping.DEFAULT_CKPT_MINUTES,
                 help="minutes between checkpoints by time (0: none), and never sooner than a save's measured"
                      f" cost allows: {100 * stopping.SAVE_SHARE:g} percent of the run's time at most"
                      " (docs/checkpoints.md)")  # fmt: skip
  r.add_argument("--ckpt-async", choices=("auto", "on", "off"), default="auto",
                 help="write a periodic save beside the next steps: auto where the host's memory allows (the save's"
                      " copies within 8 GiB and half the available memory), on always (its copies may need twice"
                      " the host state), off never (training waits for each save)")  # fmt: skip
  r.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep (the newest)")
  r.add_argument("--no-ckpt", action="store_true",
                 help="write no checkpoints (not even the final one); an earlier run's are left alone (with --resume:"
                      " continue from the newest and write no more, for a disk without room for another)")  # fmt: skip
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
                      " (perfetto_trace.json.gz), and what the step's threads did on the host"
                      " (spans.json)")  # fmt: skip
  return p


@dataclasses.dataclass(frozen=True)
class Flags:
  """The command line read once and checked, with every default resolved that needs no jax backend: what
  ``train.gpt.main`` sets before jax starts one (XLA's flags, the pinned pool's cap, the devices, the calibration)
  is decided from this. :class:`TrainConfig` adds the values that need the backend. Never mutated."""

  arch: str  # gpt or llama (llama with --init-from)
  preset: str | None  # None with --init-from: its config.json gives the model
  init_from: str | None
  n_layer: int | None  # None: the preset's (likewise --n-head, --d-model)
  n_head: int | None
  d_model: int | None
  vocab_size: int | None  # None: the preset's, else the data's (train.gpt)
  param_dtype: str
  remat: str
  data: str | None  # None: the Python standard library's sources
  packing: str  # rows (a .jsonl's default: rows as examples) or stream (windows of one token stream)
  tokenizer: str | None
  batch: int
  seq_len: int
  grad_accum: int
  steps: int
  lr: float
  min_lr: float
  warmup: int
  decay_steps: int
  beta1: float
  beta2: float
  weight_decay: float
  clip: float
  seed: int
  offload: str
  subgroup_size: int
  resident_gb: float | None
  staging_gb: float | None
  delay: int
  delay_warmup: int
  moments: str
  write_behind: bool
  delay_predict: str | None
  overlap: str
  pinned_memory: str
  grad_flush: str
  devices: int | None
  eval_every: int
  eval_batches: int
  log_every: int
  peak_flops: float | None
  out: str
  ckpt_every: int
  ckpt_every_minutes: float
  ckpt_async: str
  keep: int
  no_ckpt: bool
  resume: bool
  overwrite: bool
  plot: bool
  quiet: bool
  profile: tuple[int, int] | None  # (FIRST, STOP)
  schedule_given: tuple[str, ...]  # the SCHEDULE_FLAGS the command line gave: a resumed run keeps the others' values
  mesh_given: bool


@dataclasses.dataclass(frozen=True)
class TrainConfig(Flags):
  """A training run's configuration: ``python -m train.gpt``'s command line parsed once (:func:`parse_args`), every
  default resolved, one typed field per flag and per value derived from them. Never mutated: a resumed run that keeps
  its checkpoint's learning-rate schedule gets a new config (:func:`resumed_schedule`, ``dataclasses.replace``). Its
  ``dataclasses.asdict`` is JSON, each checkpoint's meta's ``args`` (``mesh`` is a dict for that: don't change it)."""

  compute_dtype: str  # default bfloat16 on a GPU, float32 otherwise
  mesh: dict[str, int] | None  # {"data": D, "fsdp": F}; None: one device
  global_batch: int  # rows of a micro-batch over every device: --batch x devices


def parse_args(argv: list[str] | None = None, before_backend: Callable[[Flags], None] | None = None) -> TrainConfig:
  """The run's :class:`TrainConfig`: ``argv`` parsed once and checked, any inconsistency an argparse error saying
  what to change. The values that need no jax backend come first, and ``before_backend`` (if given) is called with
  them (:class:`Flags`) to set what must be set before jax starts a backend (``train.gpt.main``); then the default
  ``--compute-dtype``, ``--devices`` and the mesh start jax's backend: set XLA's environment before calling this."""
  parser = build_parser()
  values = vars(parser.parse_args(argv))  # the one parse: a plain dict from here on, resolved, then frozen
  flags = _without_backend(values, parser.error)
  if before_backend is not None:
    before_backend(flags)
  return _with_backend(flags, values["compute_dtype"], values["mesh"], parser.error)


def _flag(name: str) -> str:
  return f"--{name.replace('_', '-')}"


def _without_backend(v: dict[str, Any], err: _Error) -> Flags:
  """The :class:`Flags` of the parsed values ``v`` (each default resolved in ``v``, ``--mesh``'s text replaced by its
  sizes); ``err`` (argparse's) for an inconsistency."""
  v["schedule_given"] = tuple(name for name in SCHEDULE_FLAGS if v[name] is not None)  # before the defaults
  for name in ("batch", "grad_accum", "steps", "eval_batches", "log_every", "keep", "subgroup_size"):
    if v[name] < 1:
      err(f"{_flag(name)} must be >= 1, got {v[name]}.")
  for name in ("eval_every", "ckpt_every", "ckpt_every_minutes", "clip", "weight_decay", "delay_warmup"):
    if v[name] < 0:
      err(f"{_flag(name)} must be >= 0, got {v[name]}.")
  for name in ("n_layer", "n_head", "d_model", "vocab_size"):
    if v[name] is not None and v[name] < 1:
      err(f"{_flag(name)} must be >= 1, got {v[name]}.")
  jsonl = v["data"] is not None and v["data"].endswith(".jsonl")
  if v["packing"] == "rows" and not jsonl:
    err(f"--packing rows packs a .jsonl's rows into sequences; {v['data'] or 'the default corpus'} is a token"
        " stream (drop --packing, or give --data FILE.jsonl).")  # fmt: skip
  v["packing"] = v["packing"] or ("rows" if jsonl else "stream")
  overrides = {k: v[k] for k in SHAPE_FLAGS if v[k] is not None}
  if v["init_from"] is not None:
    given = [_flag(name) for name in ("preset", *SHAPE_FLAGS, "vocab_size") if v[name] is not None]
    if v["arch"] == "gpt" or given:
      err(f"--init-from takes the model from {v['init_from']}/config.json (a Llama-family model, --arch llama);"
          f" drop {', '.join(given or ['--arch gpt'])}.")  # fmt: skip
    v["arch"] = "llama"
    try:
      block = hf.llama_config(hf.read_config(v["init_from"])).block_size
    except hf.CheckpointError as e:
      err(f"--init-from {v['init_from']}: {e}")
    v["seq_len"] = min(block, FINE_TUNE_SEQ_LEN) if v["seq_len"] is None else v["seq_len"]
    v["tokenizer"] = v["init_from"] if v["tokenizer"] is None else v["tokenizer"]
    v["lr"] = FINE_TUNE_LR if v["lr"] is None else v["lr"]
    if v["warmup"] is None:
      decay = v["steps"] if v["decay_steps"] is None else v["decay_steps"]
      v["warmup"] = min(decay - 1, max(1, round(FINE_TUNE_WARMUP * decay)))
    what = f"the model of {v['init_from']}"
  else:
    v["arch"], v["preset"] = v["arch"] or "gpt", v["preset"] or "tiny"
    arch, preset = v["arch"], v["preset"]
    presets = ARCHS[arch].PRESETS
    if preset not in presets:
      err(f"--preset {preset} is not a preset of --arch {arch}; choose one of {', '.join(presets)}.")
    shape = {**presets[preset], **overrides}
    if shape["d_model"] % shape["n_head"]:
      err(f"--d-model {shape['d_model']} must be divisible by --n-head {shape['n_head']}.")
    try:
      model_cfg = ARCHS[arch].get_config(preset, **overrides)
    except ValueError as e:
      err(f"--arch {arch} --preset {preset} with these sizes: {e}")
    block = shape["block_size"]
    v["seq_len"] = block if v["seq_len"] is None else v["seq_len"]
    what = f"preset {preset!r}"
    if v["warmup"] is None:
      decay = v["steps"] if v["decay_steps"] is None else v["decay_steps"]
      large = ARCHS[arch].param_count(model_cfg) >= LARGE_MODEL
      v["warmup"] = LARGE_WARMUP if large else min(100, decay // 10)
  if not 1 <= v["seq_len"] <= block:
    err(f"--seq-len {v['seq_len']} must be between 1 and the block size of {what} ({block}).")
  v["lr"] = DEFAULT_LR.get(v["preset"], FALLBACK_LR) if v["lr"] is None else v["lr"]
  if v["lr"] <= 0:
    err(f"--lr must be > 0, got {v['lr']}.")
  v["min_lr"] = v["lr"] / 10 if v["min_lr"] is None else v["min_lr"]
  if not 0 <= v["min_lr"] <= v["lr"]:
    err(f"--min-lr must be in [0, --lr={v['lr']}], got {v['min_lr']}.")
  v["decay_steps"] = v["steps"] if v["decay_steps"] is None else v["decay_steps"]
  if v["warmup"] < 0:
    err(f"--warmup must be >= 0, got {v['warmup']}.")
  for name in ("beta1", "beta2"):
    if not 0 <= v[name] < 1:
      err(f"--{name} must be in [0, 1), got {v[name]}.")
  if v["peak_flops"] is not None and v["peak_flops"] <= 0:
    err(f"--peak-flops must be > 0, got {v['peak_flops']}.")
  offload, accum, flush = v["offload"], v["grad_accum"], v["grad_flush"]
  moments, predict = v["moments"], v["delay_predict"]
  if v["param_dtype"] is None:
    v["param_dtype"] = "float32" if offload == "none" else "bfloat16"
  if offload == "none" and v["param_dtype"] != "float32":
    err("--offload none trains float32 parameters with plain optax.adamw (no float32 master copy);"
        " use --param-dtype float32, or an offload mode for bfloat16 parameters.")  # fmt: skip
  if v["delay"] and offload == "none":
    err("--delay 1 delays the host update of jax_dos; it needs an offload mode, not --offload none.")
  if v["write_behind"] and (v["delay"] or offload == "none"):
    err("--write-behind defers the host state's writes of an offload mode without --delay; drop one of them.")
  if flush is None:
    v["grad_flush"] = "host" if accum == 1 else "none"
  elif accum > 1 and flush != "none":
    err(f"--grad-accum {accum} sums the gradients on the accelerator, so there is nothing to flush during"
        f" the backward pass; drop --grad-flush {flush} (or use --grad-accum 1).")  # fmt: skip
  if moments != "float32" and offload == "none":
    err(f"--moments {moments} stores jax_dos's moments compactly; --offload none trains with optax.adamw. Pick"
        " an offload mode or drop --moments.")  # fmt: skip
  if moments != "float32" and predict:
    err(f"--delay-predict works from float32 moments; drop it or use --moments float32 (not {moments}).")
  if predict and not v["delay"]:
    err("--delay-predict predicts the weights a delayed update hands on; add --delay 1.")
  if v["plot"] and importlib.util.find_spec("matplotlib") is None:
    err(f"--plot: {progress.MATPLOTLIB_MISSING} (or drop --plot, and plot later with python -m train.plot <out>).")
  if v["resume"] and v["overwrite"]:
    err("--resume and --overwrite contradict each other; pick one.")
  if v["profile"] is not None:
    try:
      first, stop = (int(x) for x in v["profile"].split(":"))
    except ValueError:
      err(f"--profile {v['profile']}: give FIRST:STOP, two step numbers, e.g. --profile 6:8 for steps 6 and 7.")
    if not 2 <= first < stop <= v["steps"] + 1:
      err(f"--profile {v['profile']}: give 2 <= FIRST < STOP <= --steps + 1 = {v['steps'] + 1} (step 1 compiles,"
          " so a profile starts at step 2 or later).")  # fmt: skip
    v["profile"] = (first, stop)
  v["mesh_given"] = v["mesh"] is not None
  if v["mesh"] is not None:
    try:
      v["mesh"] = parallel.parse_mesh(v["mesh"])
    except ValueError as e:
      err(str(e))
  if v["out"] is None:
    v["out"] = os.path.join("runs", _model_name(v["init_from"], v["arch"], v["preset"]))
  flags = Flags(**{f.name: v[f.name] for f in dataclasses.fields(Flags)})
  if flags.overlap == "on" and overlapped.refusal(flags):
    err(f"--overlap on: {overlapped.refusal(flags)}; drop --overlap on.")
  return flags


def _with_backend(flags: Flags, compute_dtype: str | None, mesh: dict[str, int] | None, err: _Error) -> TrainConfig:
  """The :class:`TrainConfig` of ``flags``, ``--compute-dtype`` (``None``: by the backend) and ``--mesh``'s sizes
  (``None``: not given), the devices checked (``err``: argparse's error); starts jax's backend."""
  if compute_dtype is None:
    compute_dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
  if flags.devices is not None and flags.devices > jax.local_device_count():
    err(f"--devices {flags.devices}: this process has {jax.local_device_count()} device(s)"
        f" ({jax.devices()[0].device_kind}); give at most that.")  # fmt: skip
  mesh = mesh if mesh is not None else parallel.default_mesh()
  devices = 1
  if mesh is not None:
    devices = mesh["data"] * mesh["fsdp"]
    if devices != jax.device_count():
      cpu = jax.default_backend() == "cpu" and jax.process_count() == 1 and devices > jax.device_count()
      cpu = cpu and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
      hint = (f", or --devices {devices}: on a CPU it makes {devices} CPU devices" if cpu
              else ", or --devices to train on fewer")  # fmt: skip
      err(f"--mesh data={mesh['data']},fsdp={mesh['fsdp']} lays out {devices} devices; this job has"
          f" {jax.device_count()} ({jax.process_count()} process(es) x {jax.local_device_count()}): give sizes whose"
          f" product is that{hint}.")  # fmt: skip
  if flags.moments == "int8" and devices > 1:
    err(f"--moments int8 keeps each parameter's moments whole on one device; this run lays its parameters over"
        f" {devices} devices (--mesh data={mesh['data']},fsdp={mesh['fsdp']}). Use --moments bfloat16 on a mesh (a"
        " checkpoint of any format resumes in it), or train on one device (--devices 1).")  # fmt: skip
  resolved = {f.name: getattr(flags, f.name) for f in dataclasses.fields(Flags)}
  return TrainConfig(**resolved, compute_dtype=compute_dtype, mesh=mesh, global_batch=flags.batch * devices)


def _model_name(init_from: str | None, arch: str, preset: str | None) -> str:
  if init_from is not None:
    return os.path.basename(os.path.normpath(init_from))
  return preset if arch == "gpt" or preset.startswith(arch) else f"{arch}-{preset}"


def model_name(flags: Flags) -> str:
  """A short name of the run's model: its preset (``llama-`` before a llama's shared one), or its checkpoint
  folder's name."""
  return _model_name(flags.init_from, flags.arch, flags.preset)


def model_config(flags: Flags, **fields: Any) -> Any:
  """The run's model config (jax need not have started): ``--init-from``'s ``config.json`` (``models.hf``;
  ``hf.CheckpointError`` naming what it cannot express), else ``--arch``'s preset with the shape flags; ``fields``
  set more (``vocab_size``, ``dtype``, ``param_dtype``, ``remat``)."""
  if flags.init_from is not None:
    fields.pop("vocab_size", None)  # the checkpoint's own
    return hf.llama_config(hf.read_config(flags.init_from), **fields)
  return model_module(flags).get_config(flags.preset, **model_overrides(flags), **fields)


def model_module(flags: Flags) -> ModuleType:
  """The module of ``--arch``'s model (``models.gpt`` or ``models.llama``; ``llama`` with ``--init-from``)."""
  return ARCHS[flags.arch]


def model_overrides(flags: Flags) -> dict[str, int]:
  """The model-shape flags that were given (they override the preset)."""
  return {k: getattr(flags, k) for k in SHAPE_FLAGS if getattr(flags, k) is not None}
