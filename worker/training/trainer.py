"""The training loop: identical for every encoding, so curves differ only by the encoding.

AdamW with weight decay on the model's matrices (never on the position encoding's
own parameters, nor on gains), or Muon on the blocks' matrices with AdamW on the rest
(``train.optimizer``), linear warmup then cosine decay to ``min_lr_ratio``
x the peak, gradient clipping. bf16 autocast on CUDA, fp32 on the CPU. The
``Trainer`` holds the state (model, optimizer, RNG states, step, curve, the running
interval) that its checkpoints hold; a run that finds its own checkpoint resumes
from it and continues exactly as if it had never stopped (on the CPU bit for bit;
CUDA's atomic-add kernels make even two uninterrupted runs differ in the last bits).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from core.results_schema import TrainPoint
from core.spec import TrainSpec
from worker import liveness
from worker.data.base import Batch, Task
from worker.model import Transformer
from worker.training.checkpoint import Checkpointer, DiskBudget
from worker.training.hooks import NO_HOOKS, RunHooks

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class RunCancelled(RuntimeError):
    """``should_stop`` asked the run to stop (cooperative cancel)."""


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None  # None: nothing trained (an hf: model)
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


class MuonWithAdamW:
    """Muon on the blocks' weight matrices, AdamW on every other parameter, stepped as one
    optimizer (what the trainer and its checkpoints ask of one: ``param_groups``,
    ``state``, ``zero_grad``, ``step``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {**self.muon.state, **self.adamw.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def make_optimizer(model: Transformer, spec: TrainSpec) -> torch.optim.AdamW | MuonWithAdamW:
    # Decay the model's matrices (embedding, projections); never gains, and never the
    # position encoding's own parameters (T5's bucket table, a learned position table,
    # KERPLE's r1 / r2, FIRE's MLP): decay would pull them toward no position signal,
    # more for some encodings than others, and the encoding is what is compared.
    encoding = {id(p) for p in model.encoding.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2 and id(p) not in encoding]
    keep = [p for p in trainable if p.dim() < 2 or id(p) in encoding]
    # One fused kernel per step instead of a dozen ops per parameter (CPU: 0.85 ms
    # against 2.9 ms for the benchmark's model).
    fused = next(model.parameters()).device.type in ("cpu", "cuda")

    def adamw(decayed: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        groups = [
            {"params": decayed, "weight_decay": spec.weight_decay},
            {"params": keep, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), fused=fused or None)

    if spec.optimizer == "adamw":
        return adamw(decay)
    # Muon orthogonalises each hidden matrix's momentum (Newton-Schulz) and scales its lr
    # so that an update has AdamW's size (torch's match_rms_adamw): one lr for both. The
    # embedding (tied to the output) and the vectors stay with AdamW.
    hidden = {id(p) for p in model.blocks.parameters() if p.dim() == 2} - encoding
    muon = torch.optim.Muon(
        [p for p in decay if id(p) in hidden],
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return MuonWithAdamW(muon, adamw([p for p in decay if id(p) not in hidden]))


def batch_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return scored_loss(logits, batch.targets, batch.scored)


def scored_loss(
    logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor | None
) -> torch.Tensor:
    """Mean cross-entropy over the targets (those ``scored`` where a task marks them).
    Under torch.compile the scored ones are weighted instead of selected: a selection's
    size depends on the data, which would stop the graph and wait for the device."""
    logits = logits.float()
    if scored is None:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if not torch.compiler.is_compiling():
        return F.cross_entropy(logits[scored], targets[scored])
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    weights = scored.flatten().to(losses.dtype)
    return (losses * weights).sum() / weights.sum()


@contextlib.contextmanager
def tf32_matmuls(device: torch.device) -> Iterator[None]:
    """TF32 tensor cores for the float32 matmuls of training on CUDA (the tied output layer:
    bf16 autocast covers the rest; TF32 keeps 3 more mantissa bits than bf16), restored
    afterwards so that evaluation scores in full float32."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class Trainer:
    """Trains ``model`` on ``task`` for ``spec.steps`` steps: ``fit()`` resumes from the
    checkpoint when there is one, then runs ``train_step()`` with a report every
    ``spec.progress_every`` steps, a validation every ``spec.val_every`` steps (and at
    the last one) and a checkpoint every ``spec.checkpoint_every`` steps, but no sooner
    than ``min_checkpoint_seconds`` after the last one, and none that would take the
    ``disk_budget``'s folder past its bound (the last step's, and a stopped run's, are
    always written).

    The data order depends on ``seed`` alone, so every encoding sees the same batches.
    ``validate`` gives the held-out loss of the weights now
    (``worker.evaluate.validation_loss``); its value joins that step's report.
    ``hooks`` hear every report, and are asked after every step whether to stop and
    before every checkpoint whether this process may still write it.
    """

    def __init__(
        self,
        model: Transformer,
        task: Task,
        spec: TrainSpec,
        *,
        seed: int,
        device: torch.device,
        checkpointer: Checkpointer | None = None,
        validate: Callable[[], float] | None = None,
        hooks: RunHooks = NO_HOOKS,
        min_checkpoint_seconds: float = 0.0,
        disk_budget: DiskBudget | None = None,
    ) -> None:
        self.model, self.task, self.spec, self.device = model, task, spec, device
        self.min_checkpoint_seconds, self.disk_budget = min_checkpoint_seconds, disk_budget
        self._saved_clock = 0.0  # when (perf_counter) the last checkpoint was written
        self.checkpointer, self.validate, self.hooks = checkpointer, validate, hooks
        model.to(device)
        model.train()
        self.optimizer = make_optimizer(model, spec)
        self.data_rng = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # randomized positions draw from the global generator
        self.step = 0
        self.lr = float("nan")  # the last step's
        self.curve: list[TrainPoint] = []
        self.elapsed_before = 0.0  # seconds of the attempts before a resume
        # The reporting interval (it may have begun before a resume): its summed loss,
        # on the device so that a step needs no host sync, and its steps.
        self.loss_sum = torch.tensor(0.0, device=device)
        self.interval_steps = 0
        self._autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        # train.compile: forward and loss as one compiled graph, whose backward AOTAutograd
        # compiles with it; nothing in it waits for the device.
        self._loss = torch.compile(self.micro_batch_loss) if spec.compile else self.micro_batch_loss
        self._started: float | None = None
        # Tokens read in this process since the last report, and when it was (throughput).
        self._timed_tokens, self._interval_start = 0, 0.0
        self._saved_at: int | None = None  # the step the last checkpoint holds

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (what a checkpoint holds)."""
        state = {
            "step": self.step,
            # The interval in progress, so a resumed run reports the same curve.
            "interval": {"loss_sum": float(self.loss_sum.item()), "steps": self.interval_steps},
            "elapsed": self.elapsed(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "data_rng": self.data_rng.get_state(),
            "curve": [asdict(p) for p in self.curve],
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["cpu_rng"].cpu())
        self.data_rng.set_state(state["data_rng"].cpu())
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)
        self.step = int(state["step"])
        known = set(TrainPoint.__dataclass_fields__)  # a later version may add fields
        self.curve = [
            TrainPoint(**{k: v for k, v in p.items() if k in known}) for p in state["curve"]
        ]
        self.elapsed_before = float(state["elapsed"])
        self.interval_steps = int(state["interval"]["steps"])
        self.loss_sum = torch.tensor(float(state["interval"]["loss_sum"]), device=self.device)

    def elapsed(self) -> float:
        """Seconds of training over every attempt."""
        now = time.perf_counter()
        return self.elapsed_before + (now - self._started if self._started is not None else 0.0)

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train to ``spec.steps`` (or to ``stop_after``, for tests: stopping there is
        like a kill) from the checkpoint, if any; the model is left in eval mode."""
        state = self.checkpointer.load(self.device) if self.checkpointer else None
        if state is not None:
            self.load_state_dict(state)
        resumed_from, spec = self.step, self.spec
        end = spec.steps if stop_after is None else min(spec.steps, stop_after)
        self._started = self._interval_start = time.perf_counter()
        self._saved_clock = self._started  # the floor counts from the start (or the resume)
        with tf32_matmuls(self.device):
            self._fit_to(end)
        self.model.eval()
        return TrainResult(
            steps=self.step,
            final_loss=self.curve[-1].loss if self.curve else float("nan"),
            resumed_from=resumed_from,
            seconds=time.perf_counter() - self._started,
            curve=self.curve,
        )

    def _fit_to(self, end: int) -> None:
        spec = self.spec
        while self.step < end:
            self.train_step()
            validating = self.validate is not None and spec.val_every > 0
            validating = validating and (self.step % spec.val_every == 0 or self.step == spec.steps)
            # The last step reports; stopping early (stop_after) is like a kill.
            report = validating or self.step % spec.progress_every == 0 or self.step == spec.steps
            if report:
                self.report(validating)
            periodic = self.step % spec.checkpoint_every == 0 and self._spaced()
            if self.step == end:
                self.checkpoint()
            elif periodic and self._fits():
                self.checkpoint(periodic=True)
            # Every step: should_stop reads flags the heartbeat and the reports keep fresh.
            if self.hooks.should_stop():
                self.checkpoint()
                raise RunCancelled(f"cancelled at step {self.step} of {spec.steps}")
            if report:
                # Time spent reporting and checkpointing is not charged to the next interval.
                self._interval_start = time.perf_counter()

    def train_step(self) -> None:
        """One optimizer step on the mean loss of ``grad_accum`` micro-batches."""
        spec = self.spec
        self.lr = lr_at(self.step, spec)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.zero_grad(set_to_none=True)
        length = spec.length
        if spec.min_length is not None:  # drawn from the data generator: same for every run
            bounds = (spec.min_length, spec.length + 1)
            length = int(torch.randint(*bounds, (1,), generator=self.data_rng))
        if spec.compile and not self.model.attention_ran["train"]:
            # A compiled forward runs no Python to record what attention it traced.
            self.model.note_attention(self.model.attention_choice(self.device, backward=True), True)
        for _ in range(spec.grad_accum):
            batch = self.task.train_batch(spec.batch_size, length, self.data_rng).to(self.device)
            loss = self._loss(batch.inputs, batch.targets, batch.scored) / spec.grad_accum
            loss.backward()
            self.loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.grad_clip)
        self.optimizer.step()
        liveness.touch()
        self.step += 1
        self.interval_steps += 1
        self._timed_tokens += spec.batch_size * spec.grad_accum * length

    def micro_batch_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor | None
    ) -> torch.Tensor:
        """The loss of one micro-batch (bf16 autocast on CUDA): what a compiled step traces."""
        with self._autocast:
            logits = self.model(inputs)
        return scored_loss(logits, targets, scored)

    def report(self, validating: bool) -> TrainPoint:
        """The interval's point of the curve (with the validation loss when
        ``validating``), told to the hooks; a new interval begins."""
        mean_loss = self._finite_loss()
        now = time.perf_counter()
        throughput = self._timed_tokens / max(now - self._interval_start, 1e-9)
        val_loss = self.validate() if validating and self.validate is not None else None
        point = TrainPoint(
            step=self.step,
            loss=mean_loss,
            lr=self.lr,
            tokens_per_second=throughput,
            elapsed=self.elapsed(),
            val_loss=val_loss,
        )
        self.curve.append(point)
        self.loss_sum.zero_()
        self.interval_steps = self._timed_tokens = 0
        self.hooks.on_progress(point)
        return point

    def checkpoint(self, periodic: bool = False) -> None:
        """Save the state now, unless it is saved already, there is no checkpoint, or
        this process may no longer write it. A ``periodic`` one that finds the disk full
        is skipped like one over the disk budget (the file is written whole or not at
        all: the run resumes from an older one if killed); any other raises."""
        if self._saved_at == self.step or self.checkpointer is None or not self.hooks.may_write():
            return
        self._finite_loss()
        try:
            self.checkpointer.save(self.state_dict())
        except OSError as err:
            if not periodic or err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._saved_clock = time.perf_counter()
            log.warning("periodic checkpoint at step %s skipped: %s", self.step, err.strerror)
            return
        self._saved_at = self.step
        self._saved_clock = time.perf_counter()

    def _spaced(self) -> bool:
        """Whether the last checkpoint is at least ``min_checkpoint_seconds`` old."""
        return time.perf_counter() - self._saved_clock >= self.min_checkpoint_seconds

    def _fits(self) -> bool:
        """Whether a periodic checkpoint fits in the disk budget. One that does not is
        skipped (training goes on; the run resumes from an older checkpoint if killed),
        and the next is tried no sooner than the spacing floor after this one."""
        if self.disk_budget is None or self.checkpointer is None:
            return True
        problem = self.disk_budget.problem(self.state_bytes())
        if problem is None:
            return True
        self._saved_clock = time.perf_counter()
        log.warning("periodic checkpoint at step %s skipped: %s", self.step, problem)
        return False

    def state_bytes(self) -> int:
        """About what a checkpoint of the state now holds: the model's and the optimizer's
        tensors (the RNG states and the curve are small)."""
        optimizer = [v for state in self.optimizer.state.values() for v in state.values()]
        tensors = [*self.model.state_dict().values(), *optimizer]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def _finite_loss(self) -> float:
        """The interval's mean loss, checked. One host sync per report or checkpoint,
        not per step; a checkpoint never holds the weights of a diverged run."""
        mean_loss = self.loss_sum.item() / max(1, self.interval_steps)
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(
                f"the training loss became {mean_loss} between steps "
                f"{self.step - self.interval_steps + 1} and {self.step} (lr {self.lr:.3g}); "
                "try a lower learning rate"
            )
        return mean_loss
