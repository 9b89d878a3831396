"""`flashlane distill --teacher T --student S --out DIR`: knowledge distillation into an HF checkpoint."""

from __future__ import annotations

import argparse
import sys

from .help import HelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "distill", help="train a student on a teacher's next-token distributions, write an HF checkpoint",
        description="Knowledge distillation on CPU: loss = T^2 x KL(teacher || student) of the "
                    "temperature-softened next-token distributions at every position, AdamW, gradient "
                    "norm clipped to 1. The teacher is any model flashlane loads; the student a checkpoint "
                    "folder (e.g. from `flashlane prune`), trained with transformers. Training windows come "
                    "from the second half of the corpus (default: Python's pydoc_data topics), disjoint from "
                    "the first windows a perplexity evaluation scores.",
        formatter_class=HelpFormatter)
    p.add_argument("--teacher", required=True, help="teacher: checkpoint folder, .gguf file or preset")
    p.add_argument("--student", required=True, help="student: checkpoint folder or tiny preset")
    p.add_argument("--out", required=True, help="folder to create (absent or empty)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--temperature", type=float, default=2.0, help="softmax temperature T")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    p.add_argument("--batch-size", type=int, default=4, help="windows per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the window order")
    p.add_argument("--corpus", default=None,
                   help="training text: plain text or JSONL with a 'text' field (default: pydoc_data.topics)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    return p


def run(args) -> int:
    from ..compress.calibration import corpus_text
    from ..compress.checkpoint import check_out_dir
    from ..compress.distill import DistillSettings, distill, training_windows
    from ..compress.student import load_trainable, save_student, student_folder
    from ..models.registry import load_model

    settings = DistillSettings(args.steps, args.temperature, args.lr, args.seq_len, args.batch_size, args.seed)
    settings.check()
    if args.log_every < 1:
        raise ValueError(f"--log-every must be at least 1, got {args.log_every}")
    out = check_out_dir(args.out)
    teacher = load_model(args.teacher, dtype="float32")
    student = student_folder(args.student)
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"--teacher vocabulary ({teacher.config.vocab_size}) and --student vocabulary "
                         f"({student.config.vocab_size}) differ")
    if teacher.tokenizer is None:
        raise ValueError(f"--teacher {args.teacher} has no tokenizer to tokenise the corpus with")
    ids = teacher.tokenizer.encode(corpus_text(args.corpus), add_special_tokens=False)
    windows = training_windows(ids, settings)
    trainable = load_trainable(student.path)
    with _Log(args.steps, args.log_every, not args.no_progress) as log:
        result = distill(teacher.model, teacher.config, trainable, windows, settings, on_step=log.step)
    save_student(trainable, student, out)
    print(f"KL on the fixed first batch: {result.probe_before:.4f} -> {result.probe_after:.4f}; "
          f"{result.seconds_per_step:.2f} s/step over {args.steps} steps of {args.batch_size} x {args.seq_len} "
          f"tokens ({len(windows)} distinct windows)")
    print(out)
    return 0


class _Log:
    """The loss every ``every`` steps: a rich bar on stderr, or plain lines on stdout."""

    def __init__(self, total: int, every: int, bar: bool):
        self.total, self.every, self.bar = total, every, bar
        self.window: list[float] = []

    def __enter__(self):
        if self.bar:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]distill"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                     console=Console(file=sys.stderr))
            self.task = self.progress.add_task("distill", total=self.total, info="")
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.progress.stop()

    def step(self, step: int, loss: float) -> None:
        self.window.append(loss)
        if step % self.every and step != self.total:
            if self.bar:
                self.progress.update(self.task, completed=step)
            return
        line = f"step {step}/{self.total}  loss {sum(self.window) / len(self.window):.4f}"
        self.window = []
        if self.bar:
            self.progress.update(self.task, completed=step, info=line.split("  ", 1)[1])
            self.progress.console.print(line)
        else:
            print(line, flush=True)
