"""Tool calls parsed out of a model's output (specpage/serve/openai_api/
tools.py): whole, or streamed and cut anywhere, the same text and calls; and
the grammar a required or named call is constrained by."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpage.core.request import ValidationError
from specpage.serve.openai_api import tools
from tests.serving.test_tools import TEMPLATE, TOOLS

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TEXT = f"Let me look.{CALL}\n{CALL}Done <tool_ and <tool_call>not json</tool_call>"


def test_parse_finds_the_calls_and_leaves_the_text() -> None:
    content, calls = tools.parse(TEXT)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert content == "Let me look.\nDone <tool_ and <tool_call>not json</tool_call>"
    assert tools.parse("no calls") == ("no calls", [])


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_a_stream_cut_anywhere_gives_the_same_text_and_calls(cuts: list[int]) -> None:
    points = sorted(set([0, *cuts, len(TEXT)]))
    stream = tools.ToolStream()
    text, calls = "", []
    for a, b in zip(points, points[1:], strict=False):
        piece, found = stream.feed(TEXT[a:b])
        text += piece
        calls += found
    text += stream.finish()
    assert [c["function"] for c in calls] == [c["function"] for c in tools.parse(TEXT)[1]]
    assert text.replace("\n", "") == TEXT.replace(CALL, "").replace("\n", "")


def test_required_and_named_build_a_grammar_over_the_offered_functions() -> None:
    tokenizer = type("T", (), {"chat_template": TEMPLATE})()
    plan = tools.plan(TOOLS, "required", None, tokenizer)
    assert plan is not None and plan.parses and plan.parallel
    grammar = tools.constraint(plan, tokenizer)
    assert grammar is not None and "get_weather" in grammar.source and "call)*" in grammar.source
    named = tools.plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None,
                       tokenizer)
    assert named is not None
    grammar = tools.constraint(named, tokenizer)
    assert grammar is not None and "get_weather" not in grammar.source
    auto = tools.plan(TOOLS, None, None, tokenizer)
    assert auto is not None and auto.choice == "auto" and tools.constraint(auto, tokenizer) is None
    with pytest.raises(ValidationError):
        tools.plan(TOOLS, "required", None, type("T", (), {"chat_template": "{{ x }}"})())
