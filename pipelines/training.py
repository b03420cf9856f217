"""What the training commands share: seeded construction, a wall-clock step budget, the learning-rate schedule,
EMA, the loss curve and one AdamW loop (installed as `mmkv.pipelines.training`; `mmkv train video` and
`mmkv train audio` build on it)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mmkv.pipelines.common import atomic_write_json, versions

# The procedural data's seed split (video scenes and audio clips alike): training draws seeds below TRAIN_SEED_END,
# every score is measured on held_out_seeds(n), which start at HELD_OUT_SEED_START.
TRAIN_SEED_END = 10_000_000
HELD_OUT_SEED_START = 10_000_000


def held_out_seeds(n: int) -> list[int]:
    """n evaluation seeds from HELD_OUT_SEED_START up; training draws seeds below TRAIN_SEED_END only."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"held_out_seeds needs a non-negative int count, got {n!r}")
    return list(range(HELD_OUT_SEED_START, HELD_OUT_SEED_START + n))


def seeded(seed: int, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build a module whose default initialisation draws from a fixed seed, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class Budget:
    """Fits a stage's step count to its wall-clock budget. The first plan comes from the time of steps `warm`..`probe`
    (the first steps pay for CUDA context, cuDNN algorithm search and allocator growth, and would under-count what
    fits); every `probe` steps after that the plan is redone from the time of the last `probe` steps, since a GPU
    shared with another run changes speed when that run changes stage. The plan falls whenever the steps slow down
    (a SAT stage planned from its probe alone ran 704 s on a 400 s budget), and rises, up to the configured `steps`,
    while less than half of it is done: a VAE stage whose probe overlapped another lane's start ran 354 ms a step
    against its probe's 507 and, never raising its plan, ended 205 s of its 702 s early (docs/training.md). Raising
    it late would restart the cosine schedule's decay, so the second half keeps its plan or shortens it."""

    def __init__(self, steps: int, budget_s: float | None, probe: int = 50,
                 sync: Callable[[], None] | None = None, plan: list[tuple[int, int]] | None = None):
        self.sync = sync  # waits for the device's queued work before each reading of the clock (CUDA: no step syncs)
        self.cap = steps
        self.steps = steps
        self.budget_s = budget_s
        self.probe = probe
        self.warm = probe // 5
        self.start = time.perf_counter()
        self._warm_at = self.start
        self._last_at = self.start
        self.step_seconds: float | None = None
        # `plan`: a budgeted run's re-plans (its `history`), replayed instead of the clock's, so that the cosine
        # schedule, which follows the plan of the moment, sees the totals the run saw at the same steps
        self._plan = {done: total for done, total in plan[1:]} if plan else None
        if plan:
            self.steps = plan[0][1]
        self.history: list[list[int]] = [[0, self.steps]]  # [steps done, steps planned] at each change

    def update(self, done: int) -> None:
        timed = done == self.warm or (done >= self.probe and done % self.probe == 0)
        if timed and self.sync is not None:
            self.sync()
        if done == self.warm:
            self._warm_at = time.perf_counter()
        before = self.steps
        if self._plan is not None:
            self.steps = self._plan.get(done, self.steps)
        if done >= self.probe and done % self.probe == 0:
            now = time.perf_counter()
            if done == self.probe:
                seconds = (now - self._warm_at) / max(1, done - self.warm)
                self.step_seconds = seconds  # what train.json reports as the probe
            else:
                seconds = (now - self._last_at) / self.probe
            self._last_at = now
            if self._plan is None and self.budget_s is not None and seconds > 0:
                fit = done + int((self.budget_s - (now - self.start)) / seconds)
                if fit < self.steps:
                    self.steps = max(fit, done)
                elif done == self.probe or 2 * done <= self.steps:
                    self.steps = min(self.cap, fit)
        if self.steps != before:
            self.history.append([done, self.steps])


def lr_at(step: int, total: int, warmup: int, lr: float) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def ema_decay(decay: float, step: int) -> float:
    """The EMA decay after optimiser step `step` (0-based): `decay`, warmed up as min(decay, (1 + n) / (10 + n)) over
    the n = step + 1 updates so far (diffusers `EMAModel.get_decay`). Without the warm-up a stage cut short by its
    budget writes mostly its init: 644 distillation steps at 0.999 leave 0.999^644 = 52% of the teacher in the EMA
    weights (measured: the released student drew what the teacher draws in 3 steps; docs/training.md)."""
    n = step + 1
    return min(decay, (1 + n) / (10 + n))


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float, step: int) -> None:
    """One EMA step towards `model` at `ema_decay(decay, step)`."""
    d = ema_decay(decay, step)
    pairs = list(zip(ema.parameters(), model.parameters()))
    same = [(e, p) for e, p in pairs if e.dtype == p.dtype and e.device == p.device]
    if same:  # one fused launch for all of them instead of one a tensor (the same lerp, element for element)
        torch._foreach_lerp_([e for e, _ in same], [p.detach() for _, p in same], 1 - d)
    for e, p in pairs:
        if e.dtype != p.dtype or e.device != p.device:
            e.lerp_(p.detach().to(e.dtype), 1 - d)


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy that takes no gradients (EMA weights, teachers)."""
    return copy.deepcopy(module).requires_grad_(False)


@dataclass
class Curve:
    """Loss curve in windows of `every` steps (mean), for train.json and docs/training.md. A loss may be a device
    tensor: the window sums it on the device in float64 (the same additions, in the same order, as Python floats)
    and reads it back once per window, so that the steps between need not wait for the GPU."""

    every: int = 50
    points: list[tuple[int, float]] = field(default_factory=list)
    _acc: float | torch.Tensor = 0.0
    _n: int = 0

    def add(self, step: int, loss: float | torch.Tensor) -> float | None:
        """Adds one step's loss; returns the window's mean when this step closes a window, else None."""
        self._acc = self._acc + (loss.detach().double() if isinstance(loss, torch.Tensor) else loss)
        self._n += 1
        return self._close(step + 1) if self._n == self.every else None

    def flush(self, step: int) -> float | None:
        return self._close(step) if self._n else None

    def _close(self, step: int) -> float:
        mean = float(self._acc) / self._n
        self.points.append((step, mean))
        self._acc, self._n = 0.0, 0
        return mean


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor (indices and masks drawn from a CPU generator) on `device` without waiting for the GPU: a copy
    from pageable memory first waits for all the work queued before it, a copy from pinned memory does not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def optimise(params: list[torch.nn.Parameter], loss_fn: Callable[[int], torch.Tensor], *, steps: int, lr: float,
              warmup: int, budget_s: float | None, device: torch.device,
              after_step: Callable[[int], None] | None = None, log: Callable[[str], None] = print,
              name: str = "", amp: bool = True, step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """AdamW on `loss_fn(step)` for `steps` steps (cut to `budget_s`), under bf16 autocast on CUDA unless `amp` is
    False (models whose distances or spectra must stay fp32 run without it). `step_plan` replays a budgeted run's
    re-plans (its `step_plan` in train.json) in place of `steps` and the budget."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01, eps=1e-8)
    budget = Budget(steps, None if step_plan else budget_s, probe=min(50, steps),
                    sync=torch.cuda.synchronize if device.type == "cuda" else None, plan=step_plan)
    curve = Curve(every=max(1, min(50, steps // 10)))
    step = 0

    def check(mean: float | None, last: int) -> None:
        if mean is not None and not math.isfinite(mean):
            raise RuntimeError(f"{name}: loss is {mean} over the window of steps up to step {last}; "
                               "lower the learning rate")

    while step < budget.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, budget.steps, warmup, lr)
        with autocast(device) if amp else torch.autocast(device.type, enabled=False):
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if after_step is not None:
            after_step(step)
        check(curve.add(step, loss), step + 1)  # read back once a window (CUDA: no wait for the GPU per step)
        step += 1
        budget.update(step)
        if step == budget.probe:
            log(f"{name}: {budget.step_seconds * 1000:.1f} ms a step over the first {step}; running {budget.steps}")
        if step % max(1, budget.steps // 10) == 0:
            value = float(loss.detach())
            if not math.isfinite(value):
                raise RuntimeError(f"{name}: loss is {value} at step {step - 1}; lower the learning rate")
            log(f"{name}: step {step}/{budget.steps} loss {value:.5f}")
    check(curve.flush(step), step)
    seconds = time.perf_counter() - budget.start
    return {"steps": step, "planned_steps": steps, "step_plan": budget.history, "seconds": round(seconds, 2),
            "ms_per_step": round(1000 * seconds / max(1, step), 2),
            "probe_ms_per_step": round(1000 * (budget.step_seconds or 0), 2),
            "loss_curve": [[s, round(v, 6)] for s, v in curve.points]}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ----------------------------------------------------------------------------------------------------------------
# The stage command line shared by `mmkv train video` and `mmkv train audio`


def pick_config(configs: dict[str, Any], name: str, **overrides: Any) -> Any:
    """The named frozen-dataclass config (it has `to_dict`) with some fields replaced; a clear error otherwise."""
    if name not in configs:
        raise ValueError(f"unknown training config {name!r}; expected one of {', '.join(configs)}")
    cfg = configs[name]
    bad = sorted(set(overrides) - set(cfg.to_dict()))
    if bad:
        raise ValueError(f"unknown config fields {bad}; expected some of {sorted(cfg.to_dict())}")
    return dataclasses.replace(cfg, **overrides)


DETERMINISTIC_HELP = (
    "deterministic GPU kernels (torch.use_deterministic_algorithms, cuDNN without autotuning, CUBLAS_WORKSPACE_CONFIG "
    ":4096:8, attention on torch's math path), so that a rerun on the same card and software repeats the "
    "weights byte for byte (seen on an H200: docs/training.md, \"Reproducing a run\"); an op with no deterministic kernel still runs "
    "and is named in train.json (`deterministic`); slower")
# torch's warnings, with warn_only=True, for an op that has no deterministic kernel, and for one whose default
# kernel is not deterministic ("cuDNN Attention defaults to a non-deterministic algorithm. ...")
_NONDETERMINISTIC = ("does not have a deterministic implementation", "defaults to a non-deterministic algorithm")


def deterministic_kernels(on: bool, cuda: bool = True) -> list[str]:
    """Switch torch to deterministic kernels (or back to the defaults: autotuned cuDNN, which the VAE's conv3d
    shapes reward) and return the list that collects, while they are on, the ops that warned they have none.
    `cuda`: the stage runs on a GPU, whose fused attention kernels are then left out (the backend flags are global,
    and the CPU's flash kernel is deterministic already)."""
    seen: list[str] = []
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call of the process
        torch.use_deterministic_algorithms(True, warn_only=True)
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            for phrase in _NONDETERMINISTIC:
                if phrase in text and torch.are_deterministic_algorithms_enabled():
                    op = text.split(phrase)[0].strip()
                    if op not in seen:
                        seen.append(op)
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        for phrase in _NONDETERMINISTIC:
            warnings.filterwarnings("always", message=f".*{phrase}.*")
    else:
        torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on  # autotuning picks kernels by timing, which differs run to run
    # The same for compiled code (`dit_compile`): inductor times a reduction's candidate configs on the device and
    # keeps the fastest, so two processes compiling one graph may sum in other orders. On an H100 on 2026-12-07 the
    # same ten compiled steps gave the same weights three times in a process and other weights in a second process
    # (docs/training.md, "What a DiT step costs"). Its deterministic mode skips those timings, but two processes
    # still trained other weights with it on (the same probe, 2026-12-07), so `mmkv train video` refuses
    # `dit_compile` with `--deterministic`; the mode stays on for any other compiled code.
    import torch._inductor.config as inductor

    inductor.deterministic = on
    # Attention on the math path alone: with warn_only, the cuDNN, memory-efficient and flash kernels run their
    # non-deterministic backward passes (torch warns "... defaults to a non-deterministic algorithm"; flash has a
    # deterministic mode only without warn_only). On the H200 on 2026-12-04, replays with cuDNN's attention, then
    # with flash's, trained other weights (docs/training.md).
    fused = not (on and cuda)
    torch.backends.cuda.enable_cudnn_sdp(fused)
    torch.backends.cuda.enable_mem_efficient_sdp(fused)
    torch.backends.cuda.enable_flash_sdp(fused)
    return seen


def add_stage_arguments(parser, stages: tuple[str, ...], configs: dict[str, Any], source_help: str) -> None:
    parser.add_argument("--stage", required=True, choices=stages, help="which model to train (in this order)")
    parser.add_argument("--config", default="tiny", choices=sorted(configs), help="model shapes and settings")
    parser.add_argument("--from", dest="source", default=None, help=source_help)
    parser.add_argument("--init", default=None,
                        help="continue from an earlier output of the same stage (weights only; the learning-rate "
                             "schedule starts afresh): how a stage longer than one 10-minute GPU call is trained")
    parser.add_argument("--out", required=True, help="output folder (created; must not hold another stage's output)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, noise and initialisation streams")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall-clock seconds for the stage: steps are cut to fit after a 50-step timing probe")
    parser.add_argument("--steps", type=int, default=None, help="override the config's step count for this stage")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one config field (repeatable; recorded in train.json), e.g. warmup=200")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    parser.add_argument("--step-plan", default=None, metavar="DONE:STEPS,...",
                        help="replay a budgeted run's step plan (train.json's `step_plan`, e.g. 0:3000,50:986,"
                             "100:964): the learning-rate schedule follows the plan of the moment, so a replay "
                             "needs the run's re-plans, not only its final step count; overrides --steps and "
                             "--budget (`mmkv train all --replay` passes it)")


def parse_step_plan(text: str | None) -> list[tuple[int, int]] | None:
    """`--step-plan` as [(steps done, steps planned), ...]: from 0, done strictly rising, each plan at least what is
    done; a clear error otherwise."""
    if text is None:
        return None
    try:
        plan = [(int(a), int(b)) for a, b in (item.split(":") for item in text.split(","))]
    except ValueError:
        plan = []
    ok = plan and plan[0][0] == 0 and all(b >= a >= 0 for a, b in plan) and all(
        p[0] < q[0] for p, q in zip(plan, plan[1:])) and plan[-1][1] > 0
    if not ok:
        raise ValueError(f"--step-plan {text!r}: expected DONE:STEPS pairs separated by commas, the first 0:N, "
                         "DONE rising and each STEPS at least its DONE (train.json's `step_plan`)")
    return plan


def _typed(old: Any, text: str) -> Any:
    """`text` as a value of `old`'s type (JSON unless a string), or None if it is not one."""
    if isinstance(old, str):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(old, bool):
        return value if isinstance(value, bool) else None
    if isinstance(old, int):
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(old, float):
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(old, (list, tuple)):
        return type(old)(value) if isinstance(value, list) else None
    return value if isinstance(value, type(old)) else None


def parse_overrides(cfg: Any, items: list[str]) -> dict[str, Any]:
    """`--set FIELD=VALUE` items as overrides of `cfg`'s fields, each VALUE of its field's type (read as JSON:
    numbers, true / false, lists, objects; strings as they are)."""
    fields = sorted(set(cfg.to_dict()) - {"name"})  # the name picks the output files: choose it with --config
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        value = _typed(getattr(cfg, name), text)
        if value is None:
            raise ValueError(f"--set {item!r}: {name} takes a {type(getattr(cfg, name)).__name__}, got {text!r}")
        out[name] = value
    return out


@dataclass
class StageRun:
    """A stage command's checked arguments: device and folders, and a log with elapsed seconds."""

    stage: str
    device: torch.device
    out: Path
    source: Path | None
    init: Path | None
    deterministic: bool = False
    nondeterministic_ops: list[str] = field(default_factory=list)  # ops that warned, with deterministic kernels on
    step_plan: list[tuple[int, int]] | None = None  # `--step-plan`: a budgeted run's re-plans, replayed
    started: float = field(default_factory=time.perf_counter)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f}s] {msg}", flush=True)


def _stage_of(folder: Path, what: str) -> str | None:
    record = folder / "train.json"
    if not record.is_file():
        raise ValueError(f"{what} {folder} holds no train.json: give the output folder of a training stage")
    return json.loads(record.read_text()).get("stage")


def start_stage(args, first_stage: str, previous: dict[str, tuple[str, ...]] | None = None,
                init_from: dict[str, tuple[str, ...]] | None = None) -> StageRun:
    """Check a stage's arguments before anything is written: a free --out, --from for every stage after
    `first_stage` (the output of one of the stages `previous[stage]` names, when given), --init from the same stage
    (or one of `init_from[stage]`, stages whose output also holds this stage's weights); then create --out."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    step_plan = parse_step_plan(getattr(args, "step_plan", None))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu (slow) or a GPU machine")
    out = Path(args.out)
    if (out / "train.json").is_file():
        raise ValueError(f"{out} already holds a trained {_stage_of(out, '--out')!r} stage; choose another --out")
    if args.stage != first_stage and args.source is None:
        raise ValueError(f"--stage {args.stage} needs --from, the previous stage's output folder")
    source = Path(args.source) if args.source else None
    if source is not None and previous and args.stage in previous:
        wanted = previous[args.stage]
        if _stage_of(source, "--from") not in wanted:
            raise ValueError(f"--from {source} is not the output of the {' or '.join(repr(w) for w in wanted)} "
                             f"stage, which --stage {args.stage} reads")
    init = Path(args.init) if args.init else None
    accepted = (init_from or {}).get(args.stage, (args.stage,))
    if init is not None and _stage_of(init, "--init") not in accepted:
        raise ValueError(f"--init {init} is the output of the {_stage_of(init, '--init')!r} stage; --stage "
                         f"{args.stage} continues from the output of {' or '.join(repr(a) for a in accepted)}")
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    deterministic = bool(getattr(args, "deterministic", False))
    return StageRun(args.stage, device, out, source, init, deterministic,
                    deterministic_kernels(deterministic, cuda=device.type == "cuda"),
                    step_plan=step_plan)


def stage_record(run: StageRun, args, config: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """What `train.json` holds: config, seeds, folders, device, versions and the stage's statistics."""
    return {"stage": run.stage, "config": config, "seed": args.seed, "budget_s": args.budget,
            "source": str(run.source) if run.source else None, "init": str(run.init) if run.init else None,
            "device": device_name(run.device), "wall_seconds": round(time.perf_counter() - run.started, 2),
            "versions": versions(),
            **({"deterministic": {"ops_without_a_deterministic_kernel": list(run.nondeterministic_ops)}}
               if run.deterministic else {}),
            **stats}


def finish_stage(run: StageRun, args, config: dict[str, Any], stats: dict[str, Any],
                 record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `train.json` (`stage_record`, or the `record` given) last: its presence marks the stage done."""
    record = record if record is not None else stage_record(run, args, config, stats)
    atomic_write_json(run.out / "train.json", record)
    run.log(f"{run.stage}: done in {record['wall_seconds']} s -> {run.out}")
    return record
