"""Which call format a model writes, read off its chat template."""

from __future__ import annotations


def call_format(tokenizer) -> str:
    """"glm" for a template that writes GLM's ``<arg_key>`` tags (the tiny GLM presets, GLM-4.5
    and later checkpoints), else "hermes" (JSON in ``<tool_call>`` tags: Qwen, Hermes, and what
    flashlane asks of models whose template does not render tools; see ``prompt.py``)."""
    template = getattr(tokenizer, "chat_template", None)
    return "glm" if isinstance(template, str) and "<arg_key>" in template else "hermes"
