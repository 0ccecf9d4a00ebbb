"""One function renders every conversation through the model's template."""

from __future__ import annotations

from typing import Any

import pytest
from jinja2 import TemplateError

from specpage.core.chat_template import alternating_turns, chat_token_ids
from specpage.core.request import ValidationError


class Template:
    """A tokenizer's chat-template surface: one id per message's content
    length, then the assistant's opening (id 0)."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool,
                            return_dict: bool) -> dict[str, list[int]]:
        assert add_generation_prompt and return_dict
        self.seen.append(messages)
        if any(m["role"] == "tool" for m in messages):
            raise TemplateError("roles must alternate")
        return {"input_ids": [len(m["content"]) for m in messages] + [0]}


def test_a_conversation_becomes_the_template_s_ids_with_the_assistant_turn_open() -> None:
    tokenizer = Template()
    turns = alternating_turns(["hi", "hello!", "bye"])
    assert [m["role"] for m in turns] == ["user", "assistant", "user"]
    assert chat_token_ids(tokenizer, turns) == [2, 6, 3, 0]
    assert tokenizer.seen == [turns]


def test_no_template_and_a_refused_conversation_name_the_field() -> None:
    with pytest.raises(ValidationError, match="no chat template") as error:
        chat_token_ids(None, alternating_turns(["hi"]), "chat")
    assert error.value.field == "chat"
    with pytest.raises(ValidationError, match="refused it: roles must alternate") as error:
        chat_token_ids(Template(), [{"role": "tool", "content": "x"}])
    assert error.value.field == "messages"
