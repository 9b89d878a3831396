"""Knowledge distillation: a transformers student learns a flashlane teacher's next-token distributions.

Loss per token: KL(p_teacher || p_student) of the temperature-softened distributions
softmax(logits / T), times T^2 (so its gradient scale does not shrink with T), averaged over
every position of the batch. The teacher runs as a flashlane model (no gradients, any id it
loads: preset, GGUF, folder); the student is the same checkpoint folder loaded by transformers'
``AutoModelForCausalLM`` in float32, because flashlane's models run on the engine's paged cache
and are built for inference only. AdamW, gradient norm clipped to 1. Training windows are cut from
the second half of the tokenised corpus (so they do not overlap the first windows a perplexity
evaluation scores) and visited in a seeded shuffled order, epoch after epoch.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .calibration import forward_logits, tail_windows


@dataclass(frozen=True)
class DistillSettings:
    steps: int = 200
    temperature: float = 2.0
    lr: float = 1e-4
    seq_len: int = 256
    batch_size: int = 4
    seed: int = 0

    def check(self) -> None:
        for flag, value, least in (("--steps", self.steps, 1), ("--seq-len", self.seq_len, 2),
                                   ("--batch-size", self.batch_size, 1)):
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        for flag, value in (("--temperature", self.temperature), ("--lr", self.lr)):
            if not value > 0:
                raise ValueError(f"{flag} must be a positive number, got {value}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")


@dataclass
class DistillResult:
    losses: list[float] = field(default_factory=list)   # training loss of every step
    probe_before: float = float("nan")                  # loss on the fixed first batch, before training
    probe_after: float = float("nan")                   # ... and after
    seconds_per_step: float = float("nan")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over positions of KL(softmax(teacher / T) || softmax(student / T))."""
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, vocab).float() / temperature, -1)
    t = F.log_softmax(teacher_logits.reshape(-1, vocab).float() / temperature, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


def training_windows(ids: list[int], settings: DistillSettings) -> list[list[int]]:
    available = (len(ids) // 2) // settings.seq_len
    if available < settings.batch_size:
        raise ValueError(f"the second half of the corpus ({len(ids) // 2} tokens) holds fewer than "
                         f"--batch-size {settings.batch_size} windows of --seq-len {settings.seq_len}")
    return tail_windows(ids, settings.seq_len, min(available, settings.steps * settings.batch_size))


def batches(windows: list[list[int]], settings: DistillSettings):
    rng = random.Random(settings.seed)
    order: list[int] = []
    while True:
        if len(order) < settings.batch_size:
            more = list(range(len(windows)))
            rng.shuffle(more)
            order += more
        pick, order = order[:settings.batch_size], order[settings.batch_size:]
        yield [windows[i] for i in pick]


def distill(teacher, teacher_cfg, student, windows: list[list[int]], settings: DistillSettings,
            on_step: Callable[[int, float], None] | None = None) -> DistillResult:
    """Train ``student`` (a transformers causal LM) in place; ``teacher`` is a flashlane model."""
    settings.check()
    torch.manual_seed(settings.seed)
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=settings.lr, weight_decay=0.0)
    probe = windows[:settings.batch_size]
    probe_teacher = forward_logits(teacher, teacher_cfg, probe)
    result = DistillResult(probe_before=_probe(student, probe, probe_teacher, settings.temperature))
    stream = batches(windows, settings)
    start = time.perf_counter()
    for step in range(1, settings.steps + 1):
        batch = next(stream)
        target = forward_logits(teacher, teacher_cfg, batch)
        logits = student(input_ids=torch.tensor(batch)).logits
        loss = kd_loss(logits, target, settings.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        value = loss.item()
        result.losses.append(value)
        if on_step is not None:
            on_step(step, value)
    result.seconds_per_step = (time.perf_counter() - start) / settings.steps
    result.probe_after = _probe(student, probe, probe_teacher, settings.temperature)
    student.eval()
    return result


def _probe(student, batch, teacher_logits, temperature: float) -> float:
    with torch.no_grad():
        return float(kd_loss(student(input_ids=torch.tensor(batch)).logits, teacher_logits, temperature))
