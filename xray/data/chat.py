"""How a prompt becomes text before it is tokenized: the chat template a run uses and what it gets.

`data.chat_template` picks the template: `auto` (the tokenizer's own when it has one, else plain
text), `none` (plain text always: a base model that ships a template can still be trained on raw
prompts) or the path of a Jinja file. `data.chat_template_kwargs` reach the template as variables
(`enable_thinking`, say) and `data.system_prompt` is put first as a system message in every prompt
that has none. A prompt is a string (one user message) or a list of `{role, content}` messages, as
veRL's parquet `prompt` column and TRL's conversational rows hold it.

`ChatFormat` is the typed setting (`ChatFormat.of(data_config)`); `PromptRenderer` binds it to one
tokenizer, checks it once and gives each prompt's token ids. The prompt loader (`xray/data/prompts.py`)
calls it once per row and adds the row's location to its errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from xray.config.data import DataConfig

AUTO, NONE = "auto", "none"
RESERVED_KWARGS = ("conversation", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
                   "padding", "truncation", "max_length", "return_tensors", "return_dict",
                   "return_assistant_tokens_mask", "tokenizer_kwargs")
"""`apply_chat_template` arguments xray sets itself: not allowed in `data.chat_template_kwargs`."""


class ChatTemplateError(ValueError):
    """A chat setting or prompt the template cannot take; the text says the fix."""


@dataclass(frozen=True)
class ChatFormat:
    """Which chat template prompts go through, with what (the `data` section's chat settings)."""

    template: str = AUTO
    """`auto`, `none`, or the path of a Jinja chat template file."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the template (`apply_chat_template`'s keyword arguments)."""
    system_prompt: Optional[str] = None
    """Put first as a system message in every prompt without one; None: nothing added."""

    @classmethod
    def of(cls, config: DataConfig) -> "ChatFormat":
        return cls(config.chat_template, dict(config.chat_template_kwargs), config.system_prompt)

    def template_text(self, tokenizer) -> Optional[str]:
        """The Jinja template prompts are rendered with; None: they are tokenized as plain text."""
        if self.template == NONE:
            return None
        if self.template == AUTO:
            return getattr(tokenizer, "chat_template", None) or None
        path = Path(self.template).expanduser()
        if not path.is_file():
            raise ChatTemplateError(f"data.chat_template={self.template!r} is not a file; give auto, none, or "
                                    "the path of a Jinja chat template (.jinja)")
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ChatTemplateError(f"data.chat_template file {path} is empty; write the Jinja template into it")
        return text


class PromptRenderer:
    """Token ids of prompts under one `ChatFormat` and tokenizer (the settings are checked once, here)."""

    def __init__(self, tokenizer, chat: ChatFormat = ChatFormat()):
        self.tokenizer, self.chat = tokenizer, chat
        self.template = chat.template_text(tokenizer)
        if self.template is None:
            unused = [name for name, value in (("data.system_prompt", chat.system_prompt),
                                               ("data.chat_template_kwargs", chat.kwargs)) if value]
            if unused:
                why = "is none" if chat.template == NONE else "is auto and the tokenizer has no template"
                raise ChatTemplateError(f"{' and '.join(unused)} need a chat template, but data.chat_template {why}; "
                                        "set data.chat_template to auto (a tokenizer with a template) or a .jinja "
                                        f"file, or remove {' and '.join(unused)}")
        reserved = sorted(set(chat.kwargs) & set(RESERVED_KWARGS))
        if reserved:
            raise ChatTemplateError(f"data.chat_template_kwargs sets {reserved}, which xray sets itself; remove them "
                                    "(prompts are rendered with add_generation_prompt=True, then tokenized)")

    def messages(self, prompt: Any) -> list[dict[str, Any]]:
        """The chat messages of `prompt` (a string is one user message), the system prompt first
        when the prompt has no system message."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)):
            messages = [self._message(i, m) for i, m in enumerate(prompt)]
            if not messages:
                raise ChatTemplateError("the prompt is an empty list of messages; give at least one message")
        else:
            raise ChatTemplateError(f"the prompt is a {type(prompt).__name__}; it must be a string or a list of "
                                    "chat messages ({role, content})")
        if self.chat.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.chat.system_prompt})
        return messages

    @staticmethod
    def _message(index: int, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ChatTemplateError(f"message {index} of the prompt is {message!r}; each message must be a mapping "
                                    "with a string 'role' and a 'content'")
        return dict(message)

    def text(self, prompt: Any) -> str:
        """The prompt rendered by the template (with the assistant's generation prompt at the end)."""
        return self.tokenizer.apply_chat_template(self.messages(prompt), chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True, **self.chat.kwargs)

    def ids(self, prompt: Any) -> list[int]:
        """Token ids of `prompt`: rendered then tokenized without added special tokens (the template
        writes them), or, with no template, the plain string tokenized as the tokenizer does."""
        if self.template is None:
            if not isinstance(prompt, str):
                kind = type(prompt).__name__
                raise ChatTemplateError(f"the prompt is a {kind} (chat messages?) but no chat template is in use; "
                                        "give plain-text prompts, or set data.chat_template to auto (a tokenizer "
                                        "with a template) or a .jinja file")
            return list(self.tokenizer(prompt).input_ids)
        return list(self.tokenizer(self.text(prompt), add_special_tokens=False).input_ids)
