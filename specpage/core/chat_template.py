"""The one place a conversation becomes token ids: the model's own chat
template, with the assistant's turn opened. The HTTP and gRPC fronts,
`LLM(..., chat=True)` and `specpage chat` all come here, so a model's
template is applied the same way wherever a conversation arrives."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from specpage.core.request import ValidationError

# The field that carries extra template variables, in errors (vLLM's name).
TEMPLATE_KWARGS_FIELD = "chat_template_kwargs"


@dataclass(frozen=True)
class TemplateOptions:
    """How a conversation goes through the template: the assistant's turn
    opened or not, the tokenizer's special tokens (a BOS) added to the
    rendered text or not, and extra template variables (vLLM's
    chat_template_kwargs, e.g. {"enable_thinking": False})."""

    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its own
    variables: Mapping[str, Any] = field(default_factory=dict)
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's tools, for the template


DEFAULT_OPTIONS = TemplateOptions()


def chat_token_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                   field: str = "messages",
                   options: TemplateOptions = DEFAULT_OPTIONS) -> list[int]:
    """messages ({"role", "content", ...} each) through the tokenizer's chat
    template, by default ready for the assistant's next turn. A model without a
    template, or a template that refuses the conversation (one that wants
    roles to alternate, say), is a ValidationError naming field; a variable
    that is a parameter of the template call itself (`tokenize`, `tools`...)
    one naming it."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValidationError(field, "the model has no chat template")
    if options.variables:
        _check_variables(tokenizer, options.variables)
    conversation = [dict(m) for m in messages]
    variables = dict(options.variables)
    if options.tools is not None:
        variables["tools"] = [dict(t) for t in options.tools]
    try:
        if not options.add_special_tokens:  # as apply_chat_template tokenizes
            return list(tokenizer.apply_chat_template(
                conversation, add_generation_prompt=options.add_generation_prompt,
                return_dict=True, **variables)["input_ids"])
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=options.add_generation_prompt,
            tokenize=False, **variables)
    except TemplateError as error:
        raise ValidationError(field, f"the chat template refused it: {error}") from None
    return list(tokenizer.encode(text, add_special_tokens=True))


def _check_variables(tokenizer: Any, variables: Mapping[str, Any]) -> None:
    call = inspect.signature(tokenizer.apply_chat_template).parameters
    taken = next((name for name in variables if name in call
                  and call[name].kind is not inspect.Parameter.VAR_KEYWORD), None)
    if taken is not None:
        raise ValidationError(f"{TEMPLATE_KWARGS_FIELD}.{taken}",
                              "a parameter of the template call, not a template variable")


def alternating_turns(turns: Sequence[str]) -> list[dict[str, str]]:
    """User and assistant turns in turn, the user's first, as messages."""
    return [{"role": "user" if n % 2 == 0 else "assistant", "content": text}
            for n, text in enumerate(turns)]
