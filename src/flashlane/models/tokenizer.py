"""Tokenizer: a ``tokenizers.Tokenizer`` plus what serving needs around it (special ids, chat template).

Chat templates are the checkpoint's jinja2 template (``tokenizer_config.json``'s
``chat_template``, a ``chat_template.jinja`` file, or GGUF ``tokenizer.chat_template``), rendered
in a sandbox; a ChatML default is used when the checkpoint has none. The rendered prompt already
holds any BOS the template writes, so encode it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be used; the message names the file or field."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialised AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, *, bos_token: str | None = None, eos_tokens: list[str] | tuple = (),
                 eos_token_ids: list[int] | tuple = (), chat_template: str | None = None):
        self._tok = tok
        self.bos_token = bos_token if bos_token and tok.token_to_id(bos_token) is not None else None
        ids = [tok.token_to_id(t) for t in eos_tokens if t]
        ids = [i for i in ids if i is not None] + [int(i) for i in eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.has_own_chat_template = chat_template is not None
        self._compiled = None
        # added tokens (never split by BPE): id -> (text, special); decode() sets them apart
        self._added = {i: (t.content, t.special) for i, t in tok.get_added_tokens_decoder().items()}

    def __getstate__(self) -> dict:
        # a compiled jinja template can be neither copied nor pickled; it is made again on use
        return {**self.__dict__, "_compiled": None}

    # ---- ids -------------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _HFTokenizer:
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False) -> str:
        """vLLM's meaning: ``skip_special_tokens`` drops special tokens; ``spaces_between_special_tokens``
        joins the added tokens that remain and the text between them with single spaces (vLLM's
        SamplingParams default is True; a plain decode, like a fast HF tokenizer's, is False)."""
        ids = [int(i) for i in ids]
        if not spaces_between_special_tokens or not any(i in self._added for i in ids):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids:
            added = self._added.get(i)
            if added is None:
                run.append(i)
            elif not (skip_special_tokens and added[1]):
                if run:
                    parts.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(added[0])
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=False))
        return " ".join(p for p in parts if p)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
        )

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """``tokenizer.json`` plus optional ``tokenizer_config.json``, ``chat_template.jinja``,
        and eos ids from ``config.json`` / ``generation_config.json``."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            tok = _HFTokenizer.from_file(str(tj))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{tj} is not a valid tokenizers file: {exc}") from exc
        tc = _read_json(path / "tokenizer_config.json")
        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            data = _read_json(path / name)
            data = {**data.get("text_config", {}), **data} if isinstance(data.get("text_config"), dict) else data
            value = data.get("eos_token_id")
            eos_ids += [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]
        return cls(tok, bos_token=_token_text(tc.get("bos_token")), eos_tokens=[_token_text(tc.get("eos_token"))],
                   eos_token_ids=eos_ids, chat_template=template)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc
