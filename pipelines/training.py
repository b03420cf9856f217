"""What the training commands share: seeded construction, a wall-clock step budget, the learning-rate schedule,
EMA, the loss curve and one AdamW loop (installed as `mmkv.pipelines.training`; `mmkv train video` and
`mmkv train audio` build on it)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def seeded(seed: int, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build a module whose default initialisation draws from a fixed seed, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class Budget:
    """Cuts a stage's step count to its wall-clock budget, from the time of steps `warm`..`probe` (the first steps
    pay for CUDA context, cuDNN algorithm search and allocator growth, and would under-count what fits)."""

    def __init__(self, steps: int, budget_s: float | None, probe: int = 50):
        self.steps = steps
        self.budget_s = budget_s
        self.probe = probe
        self.warm = probe // 5
        self.start = time.perf_counter()
        self._warm_at = self.start
        self.step_seconds: float | None = None

    def update(self, done: int) -> None:
        if done == self.warm:
            self._warm_at = time.perf_counter()
        if done == self.probe:
            now = time.perf_counter()
            self.step_seconds = (now - self._warm_at) / max(1, done - self.warm)
            if self.budget_s is not None:
                fit = done + int((self.budget_s - (now - self.start)) / self.step_seconds)
                self.steps = max(min(self.steps, fit), done)


def lr_at(step: int, total: int, warmup: int, lr: float) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p.detach().to(e.dtype), 1 - decay)


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy that takes no gradients (EMA weights, teachers)."""
    return copy.deepcopy(module).requires_grad_(False)


@dataclass
class Curve:
    """Loss curve in windows of `every` steps (mean), for train.json and docs/training.md."""

    every: int = 50
    points: list[tuple[int, float]] = field(default_factory=list)
    _acc: float = 0.0
    _n: int = 0

    def add(self, step: int, loss: float) -> None:
        self._acc += loss
        self._n += 1
        if self._n == self.every:
            self.points.append((step + 1, self._acc / self._n))
            self._acc, self._n = 0.0, 0

    def flush(self, step: int) -> None:
        if self._n:
            self.points.append((step, self._acc / self._n))
            self._acc, self._n = 0.0, 0


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def optimise(params: list[torch.nn.Parameter], loss_fn: Callable[[int], torch.Tensor], *, steps: int, lr: float,
              warmup: int, budget_s: float | None, device: torch.device,
              after_step: Callable[[int], None] | None = None, log: Callable[[str], None] = print,
              name: str = "") -> dict[str, Any]:
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01, eps=1e-8)
    budget = Budget(steps, budget_s, probe=min(50, steps))
    curve = Curve(every=max(1, min(50, steps // 10)))
    step = 0
    while step < budget.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, budget.steps, warmup, lr)
        with autocast(device):
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if after_step is not None:
            after_step(step)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise RuntimeError(f"{name}: loss is {value} at step {step}; lower the learning rate")
        curve.add(step, value)
        step += 1
        budget.update(step)
        if step == budget.probe:
            log(f"{name}: {budget.step_seconds * 1000:.1f} ms a step over the first {step}; running {budget.steps}")
        if step % max(1, budget.steps // 10) == 0:
            log(f"{name}: step {step}/{budget.steps} loss {value:.5f}")
    curve.flush(step)
    seconds = time.perf_counter() - budget.start
    return {"steps": step, "planned_steps": steps, "seconds": round(seconds, 2),
            "ms_per_step": round(1000 * seconds / max(1, step), 2),
            "probe_ms_per_step": round(1000 * (budget.step_seconds or 0), 2),
            "loss_curve": [[s, round(v, 6)] for s, v in curve.points]}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
