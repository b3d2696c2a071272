"""The accelerator memory a run needs before anything is allocated: a model too large for the GPUs is refused.

Every GPU holds its share of the parameters (``--param-dtype``, over the ``fsdp`` axis of the mesh: ``--mesh fsdp=N``
shards them, ``data`` replicates them) and of their gradients, and with ``--offload none`` the float32 optimizer
state too (optax's AdamW: master-sized mu and nu beside float32 parameters; partitioned over the mesh's devices).
How many gradients is the step's: the plain step's program makes every gradient before the update, the overlapped
step hands each group's to its path as the backward pass completes the group (the host's leave the GPU at once), so
it holds one stage's at least. :func:`need_bytes` counts the least of the steps the run may take, which is what no
plan can do without; the activations, the resident state and the streams come on top, and the plans size those from
the step's measured programs (``gradient_step_memory``, the stages' times) once the model exists, taking the step
that fits. Where even that least exceeds a GPU, :func:`refusal` says so before anything is allocated, with the
numbers, the smallest GPU memory that would hold the model, the ``fsdp`` degree that would, and the largest preset
that fits as laid out now (issue 50's "the largest model per machine, as the planner sees it").

A GPU's memory is read as ``jax_dos.DeviceMemory`` does, right whatever ``XLA_PYTHON_CLIENT_PREALLOCATE`` and
``XLA_PYTHON_CLIENT_MEM_FRACTION`` say, and :func:`check` prints what it read (``gpu`` line).

The host holds the optimizer state the GPUs do not: :func:`host_refusal` refuses a run whose state cannot fit its
host's pinned share even with every GPU's room beside its parameters and gradients filled with state (a bound no
plan beats: the activations are not counted), with the moment formats, GPU counts and presets that would fit.

Without a GPU (the CPU backend reports no memory) the parameters, their gradients, the optimizer state and the
activations all live in the machine's RAM, and the kernel ends a process that outgrows it without a word:
:func:`ram_refusal` refuses a run whose parameters, gradients and state exceed its share of that RAM before the
parameters are made, and again once the gradient step is compiled, with its peak beside them, before the state is
made; with the moment formats, micro-batch rows and presets that would fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax

import jax_dos
from train.flags import TrainConfig, model_module, model_name

# Of a GPU's memory, what the parameters and gradients may take at most: the rest is the activations', XLA's
# workspace's and the optimizer's (the 6.7B step on an 80 GB H100 holds 13.4 GB of each beside 19 GB of activations).
PARAMS_SHARE = 0.8


def _gib(nbytes: float) -> str:
  return f"{nbytes / 2**30:.1f} GiB"


def need_bytes(
  num_params: int, param_bytes: int, fsdp: int, devices: int, offload: str, stage_params: int | None = None
) -> int:  # fmt: skip
  """Bytes one GPU holds for the model whatever the plan, before any activation: its ``1/fsdp`` of the parameters
  (``param_bytes`` each) and of their gradients, all of them, or with ``stage_params`` (the overlapped step may be
  taken: the parameters of its largest stage) that stage's only; and with ``--offload none`` its ``1/devices`` of
  optax's float32 state (mu and nu, 8 B a parameter; the parameters then float32: ``param_bytes`` 4)."""
  grads = num_params if stage_params is None else min(num_params, stage_params)
  need = param_bytes * (num_params + grads) / fsdp
  if offload == "none":
    need += 8 * num_params / devices
  return math.ceil(need)


def refusal(
  name: str, num_params: int, param_bytes: int, fsdp: int, devices: int, offload: str, device_bytes: int,
  others: Iterable[tuple[str, int]] = (), stage_params: int | None = None,
) -> str | None:  # fmt: skip
  """One message where the model cannot fit the GPUs as laid out whatever the plan (``None`` where it may), else what
  to change: the smallest GPU memory that holds it as laid out, the ``fsdp`` degree that would hold it (within
  ``devices``), and the largest of ``others`` (``(name, params)`` presets) that fits now. ``stage_params``: as
  :func:`need_bytes` (others' largest stages are taken in proportion)."""
  share = None if stage_params is None else stage_params / num_params
  need_of = lambda n, f=fsdp: need_bytes(n, param_bytes, f, devices, offload,  # noqa: E731
                                         None if share is None else math.ceil(share * n))  # fmt: skip
  need = need_of(num_params)
  room = PARAMS_SHARE * device_bytes
  if need <= room:
    return None
  advice = [f"a GPU of {_gib(need / PARAMS_SHARE)} or more"]
  wanted = next((f for f in range(fsdp + 1, devices + 1) if devices % f == 0 and need_of(num_params, f) <= room), None)
  if wanted is not None:
    advice.append(f"shard the parameters over {wanted} GPUs (--mesh fsdp={wanted}, or data=D,fsdp={wanted})")
  fits = [(n, p) for n, p in others if need_of(p) <= room]
  if fits:
    advice.append(f"train the largest preset that fits as laid out now, {max(fits, key=lambda x: x[1])[0]}")
  if offload == "none":
    advice.append("offload the optimizer state (--offload auto)")
  state = ", with --offload none its float32 state," if offload == "none" else ""
  grads = "their gradients" if stage_params is None else "its largest stage's gradients (the overlapped step's least)"
  return (
    f"{name} ({num_params / 1e9:.1f} B parameters) needs {_gib(need)} a GPU for its parameters and {grads}{state}"
    f" sharded over fsdp={fsdp}, before any activation; a GPU here has {_gib(device_bytes)}, of which they may take"
    f" {PARAMS_SHARE:.0%} ({_gib(room)}). Nothing was allocated. To train it: " + "; or ".join(advice) + "."
  )


def host_refusal(
  name: str, num_params: int, param_bytes: int, fsdp: int, devices: int, hosts: int, moments: str,
  device_bytes: int, ram_bytes: int, others: Iterable[tuple[str, int]] = (), stage_params: int | None = None,
) -> str | None:  # fmt: skip
  """One message where the optimizer state cannot fit, whatever the plan, between the GPUs and their host's pinned
  share (``None`` where it may), else what would fit.

  A host's share of the state is ``state_bytes_per_param(moments) * num_params / hosts``; its ``devices / hosts``
  GPUs keep at most their room beside the parameters and gradients (:data:`PARAMS_SHARE` of ``device_bytes`` less
  :func:`need_bytes`) resident, and the rest is pinned on the host, whose pool takes at most its share of
  ``ram_bytes`` (``jax_dos.pool_share``); ``stage_params`` as :func:`need_bytes`. The advice: the compact moment
  formats that fit (``int8`` on one device only), the GPUs of such hosts that would hold it, the largest of
  ``others`` that fits as laid out now.
  """
  gpus = devices // max(1, hosts)
  share = None if stage_params is None else stage_params / num_params

  def least(n: int, fmt: str, gpus: int) -> float:  # the host's share of the state no plan keeps off it
    stage = None if share is None else math.ceil(share * n)
    room = max(0.0, PARAMS_SHARE * device_bytes - need_bytes(n, param_bytes, fsdp, devices, "auto", stage))
    return jax_dos.state_bytes_per_param(fmt) * n / max(1, hosts) - gpus * room

  cap = jax_dos.pool_share(jax_dos.HostMemory(ram_bytes))  # the pinned pool the host's processes share
  need = least(num_params, moments, gpus)
  if need <= cap:
    return None
  advice = []
  formats = [f for f in jax_dos.MOMENT_FORMATS if jax_dos.state_bytes_per_param(f) < jax_dos.state_bytes_per_param(
    moments) and (f != "int8" or devices == 1) and least(num_params, f, gpus) <= cap]  # fmt: skip
  if formats:
    advice.append(f"store the moments compactly (--moments {formats[0]}: {_gib(least(num_params, formats[0], gpus))})")
  more = next((g for g in range(gpus + 1, 17) if least(num_params, moments, g) <= cap), None)
  if more is not None:
    advice.append(f"train on {more} GPUs of such a host or more, each holding its share resident")
  fits = [(n, p) for n, p in others if least(p, moments, gpus) <= cap]
  if fits:
    advice.append(f"train the largest preset that fits here, {max(fits, key=lambda x: x[1])[0]}")
  advice.append("use a host with more RAM")
  return (
    f"{name} ({num_params / 1e9:.1f} B parameters) with {moments} moments keeps at least {_gib(need)} of optimizer"
    f" state on this host (its {_gib(jax_dos.state_bytes_per_param(moments) * num_params / max(1, hosts))} of state"
    f" less what its {gpus} GPU(s) of {_gib(device_bytes)} could keep beside the parameters and gradients), more than"
    f" the {cap / ram_bytes:.0%} of its {_gib(ram_bytes)} of RAM it may pin ({_gib(cap)}). Nothing was"
    " allocated. To train it: " + "; or ".join(advice) + "."
  )


# Of a machine's RAM, what a run on the CPU backend may take: the rest is the system's and Python's own.
RAM_SHARE = 0.85


def ram_need_bytes(num_params: int, param_bytes: int, fsdp: int, devices: int, local: int, offload: str,
                   moments: str) -> int:  # fmt: skip
  """Bytes of RAM one process of the CPU backend holds for the model before any activation: each of its ``local``
  devices' :func:`need_bytes`, and (but with ``--offload none``, which :func:`need_bytes` counts) its ``local /
  devices`` share of the optimizer state (``jax_dos.state_bytes_per_param(moments)`` a parameter)."""
  need = local * need_bytes(num_params, param_bytes, fsdp, devices, offload)
  if offload != "none":
    need += jax_dos.state_bytes_per_param(moments) * num_params * local / devices
  return math.ceil(need)


def ram_refusal(
  name: str, num_params: int, param_bytes: int, fsdp: int, devices: int, local: int, offload: str, moments: str,
  ram_bytes: int, others: Iterable[tuple[str, int]] = (), step_bytes: int = 0, rows: int = 0,
) -> str | None:  # fmt: skip
  """One message where, on the CPU backend, the model's parameters, gradients and optimizer state
  (:func:`ram_need_bytes`), and ``step_bytes`` (the gradient step's activations and temporaries on each of the
  ``local`` devices, beyond its gradients: 0 before it is compiled) exceed :data:`RAM_SHARE` of this process's
  ``ram_bytes``; ``None`` where they do not. Else what would fit: the compact moment formats, fewer ``rows`` a
  micro-batch (where the model itself fits), the largest of ``others`` (``(name, params)`` presets)."""
  room = RAM_SHARE * ram_bytes
  need = lambda n, fmt=moments: ram_need_bytes(n, param_bytes, fsdp, devices, local, offload, fmt)  # noqa: E731
  activations = local * step_bytes
  if need(num_params) + activations <= room:
    return None
  advice = []
  if offload != "none":
    formats = [f for f in jax_dos.MOMENT_FORMATS if jax_dos.state_bytes_per_param(f) <
               jax_dos.state_bytes_per_param(moments) and (f != "int8" or devices == 1) and
               need(num_params, f) + activations <= room]  # fmt: skip
    if formats:
      advice.append(f"store the moments compactly (--moments {formats[0]})")
  if activations and need(num_params) < room:
    advice.append(f"fewer rows a micro-batch than {rows} (a smaller --batch, or a larger --grad-accum), or a shorter"
                  " --seq-len")  # fmt: skip
  fits = [(n, p) for n, p in others if need(p) <= room]
  if fits and need(num_params) > room:  # the model itself does not fit (else its activations are what to cut)
    advice.append(f"train the largest preset whose parameters and state fit here, {max(fits, key=lambda x: x[1])[0]}")
  advice.append("train on a machine with GPUs, which hold the parameters and activations")
  state = "" if offload == "none" else f" and its optimizer state ({moments} moments)"
  parts = f"its parameters, their gradients{state}"
  if activations:
    parts = (f"{parts} ({_gib(need(num_params))}) and its gradient step's activations and temporaries for {rows} rows"
             f" ({_gib(activations)})")  # fmt: skip
  else:
    parts += ", before any activation"
  return (
    f"{name} ({_millions(num_params)} parameters) needs {_gib(need(num_params) + activations)} of RAM for {parts}:"
    f" no GPU is here, and the CPU backend keeps all of them in this machine's memory, of which this process has"
    f" {_gib(ram_bytes)} and may take {RAM_SHARE:.0%} ({_gib(room)}). "
    + ("Nothing was allocated" if not activations else "Nothing but the parameters was allocated")
    + ". To train it: "
    + "; or ".join(advice)
    + "."
  )


def _millions(n: int) -> str:
  return f"{n / 1e9:.1f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def _cpu_layout(mesh: Any) -> tuple[int, int, int]:
  """``(fsdp, devices, local)``: the mesh's fsdp degree and size, and this process's devices of it."""
  if mesh is None:
    return 1, 1, 1
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return mesh.shape["fsdp"], mesh.devices.size, local


def _presets(args: TrainConfig, cfg: Any) -> list[tuple[str, int]]:
  """``(name, parameters)`` of each preset of the run's architecture, at the run's vocabulary: what may fit instead."""
  arch = model_module(args)
  return [(name, arch.param_count(arch.get_config(name, vocab_size=cfg.vocab_size))) for name in arch.PRESETS]


def _param_bytes(args: TrainConfig) -> int:
  return 4 if args.param_dtype == "float32" else 2


def check_ram(args: TrainConfig, cfg: Any, mesh: Any, step_peak_bytes: int = 0, rows: int = 0) -> None:
  """On the CPU backend, ends the run (``SystemExit``, :func:`ram_refusal`'s message) where this machine's RAM cannot
  hold the model ``cfg`` and its state, and its gradient step's peak a device (``jax_dos.StepMemory.peak_bytes``, the
  gradients in it; 0 before it is compiled) for ``rows`` rows a micro-batch."""
  if jax.local_devices()[0].platform != "cpu":
    return
  host, num_params = jax_dos.HostMemory.here(), model_module(args).param_count(cfg)
  param_bytes, (fsdp, devices, local) = _param_bytes(args), _cpu_layout(mesh)
  step_bytes = max(0, step_peak_bytes - param_bytes * num_params // fsdp)  # the gradients: ram_need_bytes' already
  message = ram_refusal(model_name(args), num_params, param_bytes, fsdp, devices, local, args.offload, args.moments,
                        host.ram_bytes // host.processes, _presets(args, cfg), step_bytes, rows)  # fmt: skip
  if message is not None:
    raise SystemExit(f"error: {message}")


def largest_stage(params: Any) -> int:
  """Parameters of the largest of a model's stages, from its parameter tree (shapes suffice): the largest block of
  ``params["blocks"]``, or of the other top-level entries (the embeddings, a head, the final norm), each counted
  alone (where two share a stage, as GPT's token and position embeddings, it errs low: a lower bound stays one)."""
  size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
  blocks = params.get("blocks", {})
  parts = [size(b) for b in (blocks.values() if isinstance(blocks, dict) else [blocks])]
  return max(parts + [size(v) for k, v in params.items() if k != "blocks"])


def may_overlap(args: TrainConfig) -> bool:
  """Whether the run may take the overlapped step (``--overlap on``, or ``auto`` on a GPU), which holds one stage's
  gradients at least, not every one."""
  from train.overlapped import refusal as overlap_refusal

  return overlap_refusal(args) is None and (args.overlap == "on" or (args.overlap == "auto" and
                                                                      jax.default_backend() == "gpu"))  # fmt: skip


def check(args: TrainConfig, cfg: Any, mesh: Any, say: Any = None) -> None:
  """Ends the run (``SystemExit``, :func:`refusal`'s message) where the model ``cfg`` cannot fit the GPUs as ``mesh``
  lays it out whatever the plan, or the host's RAM its state (:func:`host_refusal`), before anything is allocated;
  on the CPU backend, which reports no memory, where the RAM cannot hold the parameters, gradients and state
  (:func:`ram_refusal`). ``say``: where the ``gpu`` line goes (what was read of the GPU, and the least need)."""
  memories = jax_dos.DeviceMemory.of(jax.local_devices()[0])
  if memories is None:
    check_ram(args, cfg, mesh)
    return
  arch = model_module(args)
  fsdp, devices = (1, 1) if mesh is None else (mesh.shape["fsdp"], mesh.devices.size)
  others = _presets(args, cfg)
  num_params = arch.param_count(cfg)
  stage = largest_stage(arch.abstract_params(cfg)) if may_overlap(args) else None
  param_bytes, device_bytes = _param_bytes(args), memories.limit_bytes
  if say is not None:
    need = need_bytes(num_params, param_bytes, fsdp, devices, args.offload, stage)
    least = "its parameters and " + ("their gradients" if stage is None else "one stage's gradients")
    say(f"gpu     {jax.local_devices()[0].device_kind}: {memories.describe()}; the model needs {_gib(need)} a GPU"
        f" at least ({least}, before any activation)")  # fmt: skip
  message = refusal(model_name(args), num_params, param_bytes, fsdp, devices, args.offload, device_bytes, others,
                    stage)  # fmt: skip
  if message is None and args.offload not in ("none", "device"):
    host = jax_dos.HostMemory.here()
    hosts = max(1, jax.process_count() // host.processes)
    message = host_refusal(model_name(args), num_params, param_bytes, fsdp, devices, hosts, args.moments,
                           device_bytes, host.ram_bytes, others, stage)  # fmt: skip
  if message is not None:
    raise SystemExit(f"error: {message}")


def plain_step_refusal(step_memory: jax_dos.StepMemory, free_bytes: int | None = None) -> str | None:
  """Why the plain step cannot run on these GPUs (``None`` where it can): its gradient program's peak
  (``step_memory``, measured from the compiled program: every gradient, the activations) exceeds what the fullest
  local GPU has free beside the parameters (``free_bytes``, else read now), less the plans' margin
  (``jax_dos.StepMemory.room_beside``)."""
  if free_bytes is None:
    memories = [jax_dos.DeviceMemory.of(d) for d in jax.local_devices()]
    if None in memories:
      return None
    free_bytes = min(m.free_bytes for m in memories)
  short = -step_memory.room_beside(free_bytes)
  if short <= 0:
    return None
  return (f"the plain step's gradient program needs {_gib(step_memory.peak_bytes)} at its peak (every gradient and"
          f" the activations) beside the parameters: {_gib(short)} more than a GPU's {_gib(free_bytes)} free can give"
          " it; a smaller --batch with a larger --grad-accum brings its activations down")  # fmt: skip


def free_when_planned() -> str:
  """The accelerator memory free on the fullest local device now, as the plans read it
  (``jax_dos.DeviceMemory.free_bytes``), and its limit: what their room beside the step's peak is sized from, said
  in the ``memory`` line so that a run shows what it had."""
  memories = [(d, jax_dos.DeviceMemory.of(d)) for d in jax.local_devices()]
  device, m = min(memories, key=lambda dm: dm[1].free_bytes)
  return f"{m.free_bytes / 2**30:.1f} GiB free of {m.limit_bytes / 2**30:.1f} on {device} when planned"
