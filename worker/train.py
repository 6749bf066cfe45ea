"""The training loop: identical for every encoding, so curves differ only by the encoding.

AdamW with weight decay on the model's matrices (never on the position encoding's
own parameters, nor on gains), linear warmup then cosine decay to ``min_lr_ratio``
x the peak, gradient clipping. bf16 autocast on CUDA, fp32 on the CPU. A
checkpoint (model, optimizer, RNG states, step, curve, the running interval) is
written atomically and durably every ``checkpoint_every`` steps, stamped with the
run's fingerprint; a run that finds its own checkpoint resumes from it and
continues exactly as if it had never stopped (on the CPU bit for bit; CUDA's
atomic-add kernels make even two uninterrupted runs differ in the last bits). A
checkpoint of another configuration, of another format version or unreadable is
set aside and the run starts afresh.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from jobs.results_schema import TrainPoint
from jobs.spec import TrainSpec
from worker import liveness
from worker.data.base import Batch, Task
from worker.model import Transformer

CHECKPOINT_VERSION = 2
log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class RunCancelled(RuntimeError):
    """``should_stop`` asked the run to stop (cooperative cancel)."""


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    resumed_from: int
    seconds: float
    curve: list[TrainPoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "curve": [asdict(p) for p in self.curve]}


def warmup_steps(spec: TrainSpec) -> int:
    """Steps of linear warmup: the warmup fraction of the steps, rounded, and at least
    one whenever the fraction is not zero."""
    return max(1, round(spec.warmup * spec.steps)) if spec.warmup > 0 else 0


def lr_at(step: int, spec: TrainSpec) -> float:
    """Learning rate for 0-based ``step`` of ``spec.steps``: linear warmup reaching the
    peak on the last warmup step, then cosine decay reaching min_lr_ratio x peak on the
    last step (the peak is used once, the floor is reached)."""
    warmup = warmup_steps(spec)
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    decay_steps = spec.steps - warmup
    progress = (step - warmup + 1) / decay_steps if decay_steps > 0 else 1.0
    floor = spec.lr * spec.min_lr_ratio
    return floor + (spec.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: Transformer, spec: TrainSpec) -> torch.optim.AdamW:
    # Decay the model's matrices (embedding, projections); never gains, and never the
    # position encoding's own parameters (T5's bucket table, a learned position table,
    # KERPLE's r1 / r2, FIRE's MLP): decay would pull them toward no position signal,
    # more for some encodings than others, and the encoding is what is compared.
    encoding = {id(p) for p in model.encoding.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2 and id(p) not in encoding]
    keep = [p for p in trainable if p.dim() < 2 or id(p) in encoding]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    # One fused kernel per step instead of a dozen ops per parameter (CPU: 0.85 ms
    # against 2.9 ms for the benchmark's model).
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), fused=fused or None)


def batch_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    logits, targets = logits.float(), batch.targets
    if batch.scored is not None:
        return F.cross_entropy(logits[batch.scored], targets[batch.scored])
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename: never
    half a checkpoint, even after a power loss; the temporary is removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A random name: processes on different hosts sharing the folder can share a pid.
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself is durable
    finally:
        os.close(folder)


def checkpoint_problem(
    state: dict[str, Any], fingerprint: str | None, data: str | None = None
) -> str | None:
    """Why a loaded checkpoint is not this run's (another format version or, when
    ``fingerprint`` is given, another configuration; when ``data`` is given and the
    checkpoint is stamped, other data: an edited corpus file), or None when it is."""
    if state.get("version") != CHECKPOINT_VERSION:
        return f"format version {state.get('version')}, not {CHECKPOINT_VERSION}"
    if fingerprint is not None and state.get("fingerprint") != fingerprint:
        return f"another configuration ({state.get('fingerprint')})"
    if data is not None and state.get("data") not in (None, data):
        return f"trained on other data ({state.get('data')})"
    return None


def load_checkpoint(
    path: Path, device: torch.device, fingerprint: str | None = None, data: str | None = None
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` when it is this run's (same format version and, when
    given, the same fingerprint and data); None when there is none. One that is
    unreadable, of another version, configuration or data is renamed aside
    (``.stale``), so the run starts afresh instead of failing on it at every retry."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        problem = checkpoint_problem(state, fingerprint, data)
    except Exception as err:  # truncated, not a checkpoint, or not torch's format
        state, problem = None, f"unreadable ({type(err).__name__})"
    if problem is None:
        return state
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.stale")
    os.replace(path, aside)
    log.warning("checkpoint %s is %s: moved to %s, starting afresh", path, problem, aside.name)
    return None


def train(
    model: Transformer,
    task: Task,
    spec: TrainSpec,
    *,
    seed: int,
    device: torch.device,
    checkpoint: Path | None = None,
    fingerprint: str | None = None,
    on_progress: Callable[[TrainPoint], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    may_write: Callable[[], bool] | None = None,
    stop_after: int | None = None,
    validate: Callable[[], float] | None = None,
    data: str | None = None,
) -> TrainResult:
    """Train ``model`` for ``spec.steps`` steps (or until ``stop_after``, for tests).

    The data order depends on ``seed`` alone, so every encoding sees the same batches.
    ``fingerprint`` (the run's train hash) stamps the checkpoint; ``may_write`` says
    whether this process still owns the run (a worker that lost its lease must not
    overwrite the new owner's checkpoint); ``data`` (the task's fingerprint) stamps it
    too, so another run can tell what it was trained on. ``validate`` (the held-out loss of the
    weights now, ``worker.evaluate.validation_loss``) runs every ``spec.val_every``
    steps and at the last one; its value joins that step's report.
    """
    model.to(device)
    model.train()
    optimizer = make_optimizer(model, spec)
    data_rng = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # randomized positions draw from the global generator
    step, curve = 0, []
    elapsed_before, interval = 0.0, {"loss_sum": 0.0, "steps": 0}
    state = load_checkpoint(checkpoint, device, fingerprint, data) if checkpoint else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["cpu_rng"].cpu())
        data_rng.set_state(state["data_rng"].cpu())
        if device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)
        step = int(state["step"])
        known = set(TrainPoint.__dataclass_fields__)  # a later version may add fields
        curve = [TrainPoint(**{k: v for k, v in p.items() if k in known}) for p in state["curve"]]
        elapsed_before, interval = float(state["elapsed"]), state["interval"]
    resumed_from = step

    def snapshot() -> dict[str, Any]:
        snap = {
            "version": CHECKPOINT_VERSION,
            "fingerprint": fingerprint,
            "data": data,
            "step": step,
            # The interval in progress, so a resumed run reports the same curve.
            "interval": {"loss_sum": float(loss_sum.item()), "steps": interval_steps},
            "elapsed": elapsed_before + time.perf_counter() - started,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "data_rng": data_rng.get_state(),
            "curve": [asdict(p) for p in curve],
        }
        if device.type == "cuda":
            snap["cuda_rng"] = torch.cuda.get_rng_state(device)
        return snap

    forward = torch.compile(model) if spec.compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    started = time.perf_counter()
    # Steps of the reporting interval (it may have begun before a resume) and the
    # tokens read in this process since the last report (throughput).
    interval_steps, timed_tokens, interval_start = int(interval["steps"]), 0, started
    loss_sum = torch.tensor(float(interval["loss_sum"]), device=device)
    last_loss = curve[-1].loss if curve else float("nan")
    end = spec.steps if stop_after is None else min(spec.steps, stop_after)

    def check_finite() -> float:
        # One host sync per report or checkpoint, not per step; a checkpoint never
        # holds the weights of a diverged run.
        mean_loss = loss_sum.item() / max(1, interval_steps)
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(
                f"the training loss became {mean_loss} between steps "
                f"{step - interval_steps + 1} and {step} (lr {lr:.3g}); "
                "try a lower learning rate"
            )
        return mean_loss

    saved_at = None  # the step the last checkpoint holds

    def write_checkpoint() -> None:
        nonlocal saved_at
        if saved_at == step or checkpoint is None or (may_write is not None and not may_write()):
            return
        check_finite()
        save_checkpoint(checkpoint, snapshot())
        saved_at = step

    while step < end:
        lr = lr_at(step, spec)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        length = spec.length
        if spec.min_length is not None:  # drawn from the data generator: same for every run
            bounds = (spec.min_length, spec.length + 1)
            length = int(torch.randint(*bounds, (1,), generator=data_rng))
        # grad_accum micro-batches of batch_size: one optimizer step on their mean loss.
        for _ in range(spec.grad_accum):
            batch = task.train_batch(spec.batch_size, length, data_rng).to(device)
            with autocast:
                logits = forward(batch.inputs)
            loss = batch_loss(logits, batch) / spec.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        liveness.touch()
        step += 1
        interval_steps += 1
        timed_tokens += spec.batch_size * spec.grad_accum * length
        # The last step reports; stopping early (stop_after, tests) is like a kill.
        validating = validate is not None and spec.val_every > 0
        validating = validating and (step % spec.val_every == 0 or step == spec.steps)
        report = validating or step % spec.progress_every == 0 or step == spec.steps
        if report:
            mean_loss = check_finite()
            now = time.perf_counter()
            throughput = timed_tokens / max(now - interval_start, 1e-9)
            val_loss = validate() if validating else None
            point = TrainPoint(
                step=step,
                loss=mean_loss,
                lr=lr,
                tokens_per_second=throughput,
                elapsed=elapsed_before + time.perf_counter() - started,
                val_loss=val_loss,
            )
            curve.append(point)
            last_loss = mean_loss
            loss_sum.zero_()
            interval_steps = timed_tokens = 0
            if on_progress is not None:
                on_progress(point)
        if step % spec.checkpoint_every == 0 or step == end:
            write_checkpoint()
        # Every step: should_stop reads flags the heartbeat and the reports keep fresh.
        if should_stop is not None and should_stop():
            write_checkpoint()
            raise RunCancelled(f"cancelled at step {step} of {spec.steps}")
        if report:
            # Time spent reporting and checkpointing is not charged to the next interval.
            interval_start = time.perf_counter()
    model.eval()
    return TrainResult(
        steps=step,
        final_loss=last_loss,
        resumed_from=resumed_from,
        seconds=time.perf_counter() - started,
        curve=curve,
    )
