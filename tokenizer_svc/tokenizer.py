"""A model's tokenizer: HF `tokenizers` over tokenizer.json plus the Jinja2 chat template.

Chat templates from model folders are untrusted code: they render in jinja2's immutable sandbox
with the same globals HF transformers provides (raise_exception, strftime_now, a tojson that does
not HTML-escape), so the ids match `AutoTokenizer.apply_chat_template(..., tokenize=True)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmserve.token_ids import first_out_of_range


class TokenizerInputError(ValueError):
    """Bad input (a token id out of range, an empty conversation, a template that raised).

    `field` names the request field at fault, for INVALID_ARGUMENT messages.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class NoChatTemplateError(TokenizerInputError):
    """Chat input for a model whose tokenizer has no chat template."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.43 may save the template beside the config instead of inside it.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Private-use code points: no template or tokenizer gives them meaning.
_HIDE_OPEN, _HIDE_CLOSE = "\ue000", "\ue001"
_HIDDEN = re.compile(f"{_HIDE_OPEN}(\\d+){_HIDE_CLOSE}")


def _plain(m: ChatMessage | Mapping[str, str]) -> dict[str, str]:
    return {"role": m.role, "content": m.content} if isinstance(m, ChatMessage) else dict(m)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ModelTokenizer:
    """Encode, chat-encode and decode for one model folder. Thread-safe for reads."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, generation_eos: Iterable[int] = ()):
        config = config or {}
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        eos = ([eos_id] if eos_id is not None else []) + [int(i) for i in generation_eos]
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))
        max_len = config.get("model_max_length")
        # HF writes a huge sentinel (1e30) when the length is unknown.
        self.model_max_length = int(max_len) if isinstance(max_len, int | float) and max_len < 2**63 else 0
        self.chat_template_source = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelTokenizer:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (the tokenizer service needs a fast tokenizer)")
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        gen_eos: list[int] = []
        gen_file = model_dir / "generation_config.json"
        if gen_file.is_file():
            value = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
            gen_eos = [value] if isinstance(value, int) else [int(v) for v in value or []]
        return cls(Tokenizer.from_file(str(tok_file)), config, _read_chat_template(model_dir, config), gen_eos)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @cached_property
    def special_tokens(self) -> dict[int, str]:
        """id -> content of every special added token."""
        return {i: t.content for i, t in sorted(self.tokenizer.get_added_tokens_decoder().items()) if t.special}

    def check_ids(self, ids: Sequence[int], field: str = "token_ids") -> None:
        """Raise TokenizerInputError naming `field` and the first id outside [0, vocab_size)."""
        found = first_out_of_range(ids, self.vocab_size)
        if found is None:
            return
        pos, bad = found
        raise TokenizerInputError(field, f"id {bad} at position {pos} is out of range [0, {self.vocab_size})")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[ChatMessage | Mapping[str, str]],
                    add_generation_prompt: bool = False) -> str:
        if self._template is None:
            raise NoChatTemplateError("chat", "this model's tokenizer has no chat template")
        if not messages:
            raise TokenizerInputError("chat.messages", "must not be empty")
        plain = [_plain(m) for m in messages]
        try:
            return self._template.render(
                messages=plain, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                tools=None, documents=None,
            )
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...) or a template bug
            raise TokenizerInputError("chat.messages", f"chat template rejected the conversation: {e}") from e

    def encode_chat(self, messages: Sequence[ChatMessage | Mapping[str, str]],
                    add_generation_prompt: bool = False) -> tuple[list[int], str]:
        """(ids, rendered text). The template writes BOS itself, so no special tokens are added.

        A special token's string inside a message (its content or role) is encoded as plain text,
        never as the control token: otherwise a user could close their turn and forge a system
        turn. The template is rendered once with each such occurrence replaced by a placeholder,
        the text between placeholders is encoded as usual (the template's own special tokens stay
        control tokens) and each placeholder as its string's text tokens. Messages without such
        strings (nearly all) encode exactly as HF's apply_chat_template does."""
        plain = [_plain(m) for m in messages]
        found: list[str] = []
        pattern = self._special_pattern
        if pattern is not None:
            def hide(text: str) -> str:
                def placeholder(match: re.Match) -> str:
                    found.append(match.group(0))
                    return f"{_HIDE_OPEN}{len(found) - 1}{_HIDE_CLOSE}"
                return pattern.sub(placeholder, text)

            plain = [{**m, "role": hide(m.get("role", "")), "content": hide(m.get("content", ""))} for m in plain]
        rendered = self.render_chat(plain, add_generation_prompt)
        if not found:
            return self.encode(rendered, add_special_tokens=False), rendered
        ids: list[int] = []
        pieces = _HIDDEN.split(rendered)  # text, index, text, index, ..., text
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            else:
                ids += self._as_text.encode(found[int(piece)], add_special_tokens=False).ids
        text = _HIDDEN.sub(lambda m: found[int(m.group(1))], rendered)
        return ids, text

    @cached_property
    def _special_pattern(self) -> re.Pattern | None:
        tokens = sorted(set(self.special_tokens.values()), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, tokens))) if tokens else None

    @cached_property
    def _as_text(self) -> Tokenizer:
        """A copy that encodes special tokens' strings as ordinary text."""
        copy = Tokenizer.from_str(self.tokenizer.to_str())
        copy.encode_special_tokens = True
        return copy

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
