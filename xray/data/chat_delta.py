"""The token ids a chat conversation adds after the model's last answer, rendered by the chat template alone.

Sits under both multi-turn paths, so that they lay a conversation out one way: the episode runner
(`xray/run/episodes/runner.py`: an environment's and its tools' turns) and the OpenAI-compatible
endpoint (`xray/run/episodes/endpoint.py`: an agent's new messages); the tool-use demonstrations of
a warm start (`xray/env/tasks.py`) are laid out by it too. A trajectory holds the engine's own
tokens for the model's turns and must gain only what the new messages (tool results, user turns)
add, with the template's own markup, so that it stays the sequence the model would have been fed.
The history is never rendered into the trajectory again: templates rewrite it (Qwen3's strips
`<think>` from past assistant turns), and the engine's tokens of a turn need not be what tokenizing
its text gives.

`ChatRenderer.delta_ids` renders the conversation with the last answer replaced by a stand-in text
and keeps what the template writes after it: the rest of that assistant turn's markup (`<|im_end|>\n`
on ChatML), the new messages and the generation prompt. The part of that markup the engine already
produced (its end-of-turn token: the turn stopped on it; `turn_end`) is left out, so the newline
after `<|im_end|>` is kept and `<|im_end|>` is not doubled. What precedes the last answer does not
matter, so a template that rewrites earlier turns gives the same ids as one that does not.
`Conversation` is one episode's messages and tools on a renderer: its prompt, each answer, the ids
each observation adds. Messages are in the form templates take (content a string, a tool call's
arguments an object). A template that cannot render raises `ChatTemplateError` with the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from xray.data.chat import ChatTemplateError

STAND_IN = "XRAY-ANSWER-STANDS-HERE-7f3a"
"""The last answer's content while the new messages are rendered; found once in the text."""


class ChatRenderer:
    """Renders conversations with one tokenizer and template (None: contents joined, as plain text)."""

    def __init__(self, tokenizer: Any, template: Optional[str], kwargs: dict):
        self.tokenizer, self.template, self.kwargs = tokenizer, template, dict(kwargs)

    @property
    def renders_tools(self) -> bool:
        """Whether the template writes a `tools` variable (one that does not would drop the schemas)."""
        return self.template is not None and "tools" in self.template

    def render(self, messages: list[dict], generation_prompt: bool, tools: Optional[list] = None,
               extra: Optional[dict] = None) -> str:
        """`messages` as the template writes them."""
        if self.template is None:
            return "".join(m["content"] or "" for m in messages)
        kwargs = dict(self.kwargs, **(extra or {}))
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja raise_exception, a missing key)
            raise ChatTemplateError(f"the chat template cannot render these messages: {type(exc).__name__}: "
                                    f"{exc}; send messages the model's template accepts") from None

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def prompt_ids(self, messages: list[dict], tools: Optional[list] = None, extra: Optional[dict] = None) -> list[int]:
        """A conversation's first messages with the generation prompt."""
        return self.ids(self.render(messages, True, tools, extra))

    def after_answer(self, known: list[dict], new: list[dict], tools: Optional[list] = None,
                     extra: Optional[dict] = None, generation_prompt: bool = True) -> str:
        """The text the template writes after the last message of `known` (an answer) when `new` follow."""
        stand_in = known[:-1] + [{"role": "assistant", "content": STAND_IN}]
        text = self.render(stand_in + new, generation_prompt, tools, extra)
        if text.count(STAND_IN) != 1:
            raise ChatTemplateError("the chat template does not write the assistant's answer as given, so the tokens "
                                    "the new messages add cannot be found; token-exact training cannot use this "
                                    "template: give data.chat_template one that writes assistant contents verbatim")
        return text[text.index(STAND_IN) + len(STAND_IN):]

    def delta_ids(self, known: list[dict], new: list[dict], answer_end: str = "", tools: Optional[list] = None,
                  extra: Optional[dict] = None) -> list[int]:
        """What `new` adds after `known`, whose last message is the model's answer (module docstring);
        `answer_end` is the text of the answer's last token when it is an end-of-turn token."""
        after = self.after_answer(known, new, tools, extra)
        if answer_end and after.startswith(answer_end):
            after = after[len(answer_end):]
        return self.ids(after)

    def turn_end(self, ids: list[int], stop_ids=()) -> str:
        """The text of a turn's last token when it is an end-of-turn token (one of `stop_ids`, or a
        special token): what `delta_ids` must not write again; empty otherwise."""
        stops = set(stop_ids or ()) | set(self.tokenizer.all_special_ids)
        return self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids and ids[-1] in stops else ""

    def answer_text(self, known: list[dict], answer: dict, tools: Optional[list] = None) -> Optional[str]:
        """The text the template writes for `answer` (an assistant message: content, tool calls) after
        `known` and the generation prompt, up to its end-of-turn markup: what the model writes in that
        turn (a demonstration's); None when the template's answer does not extend its generation prompt."""
        prompt = self.render(known, True, tools)
        whole = self.render(known + [answer], False, tools)
        if not whole.startswith(prompt):
            return None
        body, closing = whole[len(prompt):], self.after_answer(known + [answer], [], tools, generation_prompt=False)
        return body[:len(body) - len(closing)] if closing and body.endswith(closing) else body


@dataclass
class Conversation:
    """One episode's messages on `renderer`, as its trajectory holds them: the prompt's, then each
    answer and the observations after it."""

    renderer: ChatRenderer
    messages: list[dict]
    tools: Optional[list] = None
    """The tool schemas the prompt is rendered with (None: none)."""
    answer_end: str = ""
    """The text of the last answer's end-of-turn token when the engine produced it (`turn_end`)."""

    def prompt_ids(self) -> list[int]:
        return self.renderer.prompt_ids(self.messages, self.tools)

    def answered(self, message: dict, end: str = "") -> None:
        """The model's answer (an assistant message), `end` the text of its end-of-turn token if it has one."""
        self.messages.append(message)
        self.answer_end = end

    def observe(self, new: list[dict]) -> list[int]:
        """The ids `new` add after the last answer (its turn's closing markup, the new messages, the
        generation prompt); they join the conversation."""
        ids = self.renderer.delta_ids(self.messages, new, self.answer_end, self.tools)
        self.messages += new
        self.answer_end = ""
        return ids
