"""The one place a conversation becomes token ids: the model's own chat
template, with the assistant's turn opened. The HTTP and gRPC fronts,
`LLM(..., chat=True)` and `specpage chat` all come here, so a model's
template is applied the same way wherever a conversation arrives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from specpage.core.request import ValidationError


def chat_token_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                   field: str = "messages") -> list[int]:
    """messages ({"role", "content", ...} each) through the tokenizer's chat
    template, ready for the assistant's next turn. A model without a
    template, or a template that refuses the conversation (one that wants
    roles to alternate, say), is a ValidationError naming field."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValidationError(field, "the model has no chat template")
    try:
        encoded = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, return_dict=True)
    except TemplateError as error:
        raise ValidationError(field, f"the chat template refused it: {error}") from None
    return list(encoded["input_ids"])


def alternating_turns(turns: Sequence[str]) -> list[dict[str, str]]:
    """User and assistant turns in turn, the user's first, as messages."""
    return [{"role": "user" if n % 2 == 0 else "assistant", "content": text}
            for n, text in enumerate(turns)]
