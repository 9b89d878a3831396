"""The trainable student: a checkpoint folder loaded by transformers, saved back through flashlane.

Saving copies the trained tensors into a flashlane model built from the student's config with the
loader's strict name/shape checks, then writes that model's tensors, so the folder written is
exactly one flashlane loads (and transformers, whose names flashlane uses).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.loader import load_state
from ..models.registry import LoadedModel, load_model
from .checkpoint import trunk_state, write_checkpoint


def student_folder(student_id: str) -> LoadedModel:
    loaded = load_model(student_id, dtype="float32")
    if loaded.path is None or not loaded.path.is_dir():
        raise ValueError(f"--student {student_id!r} must be a Hugging Face checkpoint folder (or a tiny preset); "
                         "a .gguf student cannot be trained: `flashlane prune` it into a folder first")
    return loaded


def load_trainable(folder: Path):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is a test dependency
        raise ValueError("flashlane distill needs transformers to train the student (pip install transformers)") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"--student {folder}: transformers cannot load it for training ({exc})") from exc
    model.config.use_cache = False
    return model.float().requires_grad_(True)


def save_student(trained, student: LoadedModel, out: str | Path) -> Path:
    tensors = {n: t.detach().float() for n, t in trained.state_dict().items()}
    load_state(student.model, tensors, student.config)   # strict: every name and shape checked
    if student.config.tie_word_embeddings:
        student.model.post_load()
    state = trunk_state(student.model, student.config)
    return write_checkpoint(out, state, dict(student.config.raw), source=student.path, tokenizer=student.tokenizer)
