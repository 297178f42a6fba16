"""Supervised fine-tuning on conversations: a row's messages rendered by the chat template, trained
on the assistant's turns only (`python -m xray.train sft`, `algorithms/sft.py`; the packing and loss
are `xray.data.sequences` and `xray.data.supervised`'s).

Two row forms are conversations: a `data.messages_field` column (`messages`, a list of
`{role, content}`), whose every assistant turn is trained; and TRL's conversational prompt /
completion (`data.prompt_field` and `data.answer_field` both messages; a string prompt is one user
message), whose completion's assistant turns are trained. Any other row is a plain (prompt, answer)
pair, trained as before (`xray.data.supervised.target_ids`).

An assistant turn's tokens are found by rendering prefixes: the conversation up to the turn with the
generation prompt, and up to the turn's end; the tokens between the two are the turn. The turn is
trained up to and including the tokenizer's EOS that closes it (`<|im_end|>` in ChatML: what the
model must learn to emit to stop); the template's header (`<|im_start|>assistant\\n`) and anything
after that EOS (a newline) are context, as are the other roles' turns. This needs each rendered
prefix to be the start of the next one: a template that rewrites earlier turns (one that drops past
reasoning, say) is refused with an error naming the row.
"""
from __future__ import annotations

from typing import Any, Optional

from xray.config.data import DataConfig
from xray.data.chat import ChatFormat, ChatTemplateError, PromptRenderer
from xray.data.files import Rows

Triple = tuple[list[int], list[int], list[int]]
"""(prompt ids, response ids, response loss mask) of one training row (`pack_sequences`)."""


class ConversationError(ValueError):
    """A conversation that cannot be trained on; the message names the row and says the fix."""


def conversation(row: dict[str, Any], data: DataConfig, where: str) -> Optional[tuple[list, int]]:
    """(messages, index of the first message whose assistant turns are trained) of a conversational
    row; None for a plain (prompt, answer) row."""
    if row.get(data.messages_field) is not None:
        messages = row[data.messages_field]
        if not isinstance(messages, list):
            raise ConversationError(f"{where}: {data.messages_field!r} is a {type(messages).__name__}, not a list "
                                    "of {role, content} messages; fix the row, or set data.messages_field")
        return messages, 0
    completion = row.get(data.answer_field)
    if not isinstance(completion, list):
        return None
    prompt = row.get(data.prompt_field)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise ConversationError(f"{where}: the completion {data.answer_field!r} is a list of messages but the "
                                f"prompt {data.prompt_field!r} is {type(prompt).__name__}; give the prompt as a "
                                "string or a list of messages, or set data.prompt_field")
    return prompt + completion, len(prompt)


def conversation_pairs(rows: Rows, tokenizer, data: DataConfig) -> Optional[list[Triple]]:
    """Each row's (prompt ids, response ids, mask) when the rows are conversations (see the module
    docstring); None when they are all plain (prompt, answer) rows. Mixed forms are an error."""
    found = [conversation(row, data, where) for row, where in zip(rows.rows, rows.where)]
    plain = [where for c, where in zip(found, rows.where) if c is None]
    if len(plain) == len(found):
        return None
    if plain:
        raise ConversationError(f"{plain[0]}: a plain (prompt, answer) row among conversations; give every row "
                                f"a {data.messages_field!r} list of messages (or messages in "
                                f"{data.prompt_field!r} and {data.answer_field!r}), or none")
    try:
        renderer = PromptRenderer(tokenizer, ChatFormat.of(data))
    except ChatTemplateError as exc:
        raise ConversationError(str(exc)) from None
    return [conversation_ids(renderer, messages, first, where)
            for (messages, first), where in zip(found, rows.where)]


def conversation_ids(renderer: PromptRenderer, messages: list, first_trained: int, where: str) -> Triple:
    """(prompt ids, response ids, response mask) of one conversation: the prompt runs up to the
    first trained assistant turn, the response to the last one's EOS, the mask is 1 on the trained
    turns' tokens (from message `first_trained` on) and 0 elsewhere."""
    if renderer.template is None:
        raise ConversationError(f"{where}: a conversation needs a chat template, and none is in use; set "
                                "data.chat_template to auto (a tokenizer with a template) or a .jinja file")
    try:
        full = renderer.messages(messages)  # checked, with data.system_prompt put first where asked
    except ChatTemplateError as exc:
        raise ConversationError(f"{where}: {exc}") from None
    first = first_trained + len(full) - len(messages)
    ids = _render(renderer, full, False, where)
    eos = renderer.tokenizer.eos_token_id
    spans = []
    for i in range(first, len(full)):
        if full[i]["role"] != "assistant":
            continue
        if i == 0:
            raise ConversationError(f"{where}: the conversation opens with an assistant turn; put the system "
                                    "or user message it answers before it")
        before = _render(renderer, full[:i], True, where)
        after = _render(renderer, full[:i + 1], False, where)
        if after[:len(before)] != before or ids[:len(after)] != after:
            raise ConversationError(
                f"{where}: the chat template does not render this conversation's turns as prefixes of one "
                f"another (message {i}, the assistant's, changes the tokens of what comes before it): the "
                "template rewrites earlier turns (as templates that drop past reasoning do), or text joins "
                "across a turn's boundary; use a template that keeps history as it is (data.chat_template)")
        turn = after[len(before):]
        ends = [k for k, t in enumerate(turn) if t == eos]
        spans.append((len(before), len(before) + (ends[-1] + 1 if ends else len(turn))))
    if not spans:
        raise ConversationError(f"{where}: no assistant message to train on (from message {first_trained} on); "
                                "give the conversation an assistant turn, or leave the row out")
    start, stop = spans[0][0], spans[-1][1]
    mask = [0] * (stop - start)
    for a, b in spans:
        mask[a - start:b - start] = [1] * (b - a)
    return ids[:start], ids[start:stop], mask


def _render(renderer: PromptRenderer, messages: list, generation: bool, where: str) -> list[int]:
    """Token ids of `messages` rendered by the template (with the assistant's header when `generation`)."""
    from jinja2.exceptions import TemplateError

    try:
        text = renderer.tokenizer.apply_chat_template(messages, chat_template=renderer.template, tokenize=False,
                                                      add_generation_prompt=generation, **renderer.chat.kwargs)
    except (TemplateError, ValueError) as exc:
        raise ConversationError(f"{where}: the chat template cannot render messages 0..{len(messages) - 1} of "
                                f"this conversation ({exc}); fix the conversation or the template") from None
    return list(renderer.tokenizer(text, add_special_tokens=False).input_ids)
