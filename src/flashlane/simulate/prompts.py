"""What the simulated server turns a request body into: the prompt's token ids.

With the model's tokenizer (a tiny preset's tokenizer.json, a GGUF's vocabulary, a checkpoint
folder's tokenizer.json) the ids are exactly the ones ``flashlane serve`` would compute: the
messages through the model's chat template, then the tokenizer (special tokens added, as the
server does). A full-size config without a tokenizer gets the approximation the bench's text
synthesis uses ("one word ~ one token"): each whitespace-separated word is one id (a hash of the
word, so equal text gives equal ids and the prefix cache sees the same sharing), plus a few ids
of role markup per message. Lengths then match what the bench asked for, not a real tokenizer.
"""

from __future__ import annotations

import zlib
from pathlib import Path

ROLE_IDS = 3          # approximation: markup tokens per message (role and separators)


class PromptTokenizer:
    def __init__(self, tokenizer=None, vocab_size: int = 32000, source: str = ""):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._message_ids: dict[tuple[str, str], list[int]] = {}   # a replay resends every message each turn
        self.source = source or ("the model's tokenizer and chat template" if tokenizer is not None
                                 else "approximation: one id per whitespace-separated word")

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def chat(self, messages: list[dict]) -> list[int]:
        """Raises ValueError when the chat template cannot render the messages (a 400)."""
        if self.tokenizer is not None and getattr(self.tokenizer, "apply_chat_template", None) is not None:
            try:
                text = self.tokenizer.apply_chat_template([{"role": _role(m), "content": _text(m)} for m in messages],
                                                          add_generation_prompt=True)
            except Exception as exc:     # jinja2's TemplateError and whatever a template raises
                raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
            return self.tokenizer.encode(text)
        ids: list[int] = []
        for m in messages:
            key = (_role(m), _text(m))
            part = self._message_ids.get(key)
            if part is None:
                part = [self._word_id(f"<|{key[0]}|>")] * ROLE_IDS + self._words(key[1])
                if len(self._message_ids) > 100_000:
                    self._message_ids.clear()
                self._message_ids[key] = part
            ids += part
        return ids + [self._word_id("<|assistant|>")]

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if self.tokenizer is not None:
            return self.tokenizer.encode(prompt)
        return self._words(prompt)

    def _words(self, text: str) -> list[int]:
        return [self._word_id(w) for w in text.split()]

    def _word_id(self, word: str) -> int:
        return 3 + zlib.crc32(word.encode()) % max(self.vocab_size - 3, 1)


def _role(message: dict) -> str:
    role = message.get("role", "user")
    return "system" if role == "developer" else role    # as flashlane serve renders it


def _text(message: dict) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):    # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def prompt_tokenizer(model: str, vocab_size: int) -> PromptTokenizer:
    """The tokenizer ``flashlane serve MODEL`` would use, when one is at hand without loading
    weights; else the approximation."""
    from .. import presets
    from ..models.tokenizer import Tokenizer

    if model in presets.PRESETS:
        preset = presets.get_preset(model)
        if preset.kind == "gguf":
            return _gguf(presets.preset_path(model), vocab_size)
        file = presets.tokenizer_file(model)
        if file is None:   # not created yet: create it (weights included) as serve would
            from ..models.registry import preset_folder
            file = preset_folder(model) / "tokenizer.json"
        return PromptTokenizer(Tokenizer.from_folder(Path(file).parent), vocab_size, f"{model}'s tokenizer")
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _gguf(path, vocab_size)
    folder = path if path.is_dir() else path.parent if path.name == "config.json" and path.is_file() else None
    if folder is not None and (folder / "tokenizer.json").is_file():
        return PromptTokenizer(Tokenizer.from_folder(folder), vocab_size, f"{folder}/tokenizer.json")
    return PromptTokenizer(None, vocab_size)


def _gguf(path: Path, vocab_size: int) -> PromptTokenizer:
    from ..models.gguf_loader import open_gguf, tokenizer_from_gguf

    return PromptTokenizer(tokenizer_from_gguf(open_gguf(path)), vocab_size, f"the tokenizer in {Path(path).name}")
