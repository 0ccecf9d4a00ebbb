"""Constraints compiled over SmolLM2's tokenizer (core/grammar.py): what a
sequence's matcher allows, forces and admits, and the errors that name the
field a bad constraint came in."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from specpage.core import grammar
from specpage.core.grammar import (
    MAX_SOURCE_BYTES,
    Constraint,
    Grammars,
    SequenceGrammar,
    json_schema,
)
from specpage.core.request import ValidationError
from specpage.models.fetch import ensure_model

VOCAB = 49152
EOS = 2  # <|im_end|>
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, VOCAB, (EOS,))


def allowed_tokens(masks: bytes, rows: int, vocab: int) -> np.ndarray:
    """[rows, vocab] bool: one bit per token, 32 to a little-endian int32."""
    bits = np.unpackbits(np.frombuffer(masks, dtype=np.uint8), bitorder="little")
    return bits.reshape(rows, -1)[:, :vocab].astype(bool)


def walk(sequence: SequenceGrammar, tokenizer, text: str) -> list[int]:
    """Commit text's tokens one by one, as steps would; each must be allowed."""
    output: list[int] = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        allowed = allowed_tokens(sequence.masks([]), 1, VOCAB)[0]
        assert allowed[token], (text, tokenizer.decode(output), tokenizer.decode([token]))
        output.append(token)
        assert sequence.take(token) is None
    return output


def test_a_schema_forces_its_punctuation_and_keys_and_completes(grammars, tokenizer):
    sequence = grammars.compile(json_schema(PERSON, "response_format")).start()
    forced = sequence.forced(16)
    assert tokenizer.decode(forced) == '{"name": "'[: len(tokenizer.decode(forced))]
    assert tokenizer.decode(forced).startswith('{"')
    walk(sequence, tokenizer, '{"name": "Ada", "age": 36}')
    assert sequence.stopped
    allowed = allowed_tokens(sequence.masks([]), 1, VOCAB)[0]
    assert allowed.nonzero()[0].tolist() == [EOS]  # only the end is left


def test_keys_come_in_the_schemas_order_as_json_dumps_writes_them(grammars, tokenizer):
    sequence = grammars.compile(json_schema(PERSON, "guided_json")).start()
    walk(sequence, tokenizer, '{"name": "Ada"')
    # the next key is "age", after one space, with no other whitespace
    for text in (',"age"', ',  "age"', ', "city"'):
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert sequence.admitted(tokens) < len(tokens), text
    right = tokenizer.encode(', "age": 36}', add_special_tokens=False)
    assert sequence.admitted(right) == len(right)
    assert tokenizer.decode(sequence.forced(8)).startswith(', "age":')


def test_masks_follow_a_proposal_and_leave_the_matcher_where_it_was(grammars, tokenizer):
    choice = grammars.compile(Constraint("choice", choices=("yes", "no"))).start()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    no = tokenizer.encode("no", add_special_tokens=False)
    assert len(yes) == 1 and len(no) == 1
    rows = allowed_tokens(choice.masks(yes), 2, VOCAB)
    assert rows[0, yes[0]] and rows[0, no[0]] and not rows[0, EOS]
    assert rows[1].nonzero()[0].tolist() == [EOS]  # after "yes", only the end
    # the proposal was rolled back: both choices are open again
    again = allowed_tokens(choice.masks([]), 1, VOCAB)[0]
    assert again[yes[0]] and again[no[0]]
    assert choice.admitted(yes + [EOS]) == 1  # never past an EOS
    assert choice.admitted(no + no) == 1


def test_a_fork_copies_the_matcher_and_each_goes_its_own_way(grammars, tokenizer):
    parent = grammars.compile(Constraint("regex", r"(cat|dog)s?")).start()
    child = parent.copy()
    walk(parent, tokenizer, "cat")
    walk(child, tokenizer, "dog")
    assert parent.admitted(tokenizer.encode("dog", add_special_tokens=False)) == 0
    assert child.admitted(tokenizer.encode("s", add_special_tokens=False)) == 1


def test_eos_is_never_proposed_and_a_token_outside_the_grammar_is_reported(grammars,
                                                                          tokenizer):
    sequence = grammars.compile(Constraint("choice", choices=("yes",))).start()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert sequence.admitted(yes + [EOS]) == len(yes)  # EOS would stop the matcher
    assert sequence.forced(8) == yes
    assert sequence.take(tokenizer.encode("no", add_special_tokens=False)[0]) is not None


def test_gbnf_and_lark_grammars_compile_to_the_same_language(grammars, tokenizer):
    gbnf = 'root ::= "ab" digit+\ndigit ::= [0-9]'
    lark = 'start: "ab" DIGITS\nDIGITS: /[0-9]+/'
    for source in (gbnf, lark):
        sequence = grammars.compile(Constraint("grammar", source)).start()
        walk(sequence, tokenizer, "ab42")
        assert sequence.admitted(tokenizer.encode("x", add_special_tokens=False)) == 0


def test_compiled_grammars_are_kept_per_source(grammars):
    before = grammars.num_compiled
    schema = json_schema({"type": "object", "properties": {"k": {"type": "boolean"}}}, "x")
    first, second = grammars.compile(schema), grammars.compile(schema)
    assert grammars.num_compiled == before + 1
    # each sample starts a matcher of its own
    a, b = first.start(), second.start()
    assert a.matcher is not b.matcher


@pytest.mark.parametrize(("constraint", "field", "says"), [
    (Constraint("json_schema", json.dumps({"type": "strin"}), field="guided_json"),
     "guided_json", "strin"),
    (Constraint("regex", "[a-z]+(", field="guided_regex"), "guided_regex", "regex"),
    (Constraint("regex", "", field="structured_outputs.regex"), "structured_outputs.regex",
     "empty"),
    (Constraint("choice", choices=(), field="guided_choice"), "guided_choice", "at least one"),
    (Constraint("choice", choices=("a", ""), field="guided_choice"), "guided_choice", "empty"),
    (Constraint("grammar", "start: undefined_rule", field="guided_grammar"), "guided_grammar",
     "undefined_rule"),
    (Constraint("grammar", 'root ::= "a" missing', field="constraint.grammar"),
     "constraint.grammar", "missing"),
    (Constraint("regex", "a" * (MAX_SOURCE_BYTES + 1), field="guided_regex"), "guided_regex",
     "exceed the limit"),
])
def test_a_bad_constraint_is_refused_naming_its_field(grammars, constraint, field, says):
    with pytest.raises(ValidationError) as caught:
        grammars.compile(constraint)
    assert caught.value.field == field
    assert says in str(caught.value)


@pytest.mark.parametrize("schema", ["{not json", "[1, 2]", "3"])
def test_a_schema_that_is_not_a_json_object_is_refused(schema):
    with pytest.raises(ValidationError) as caught:
        json_schema(schema, "response_format.json_schema.schema")
    assert caught.value.field == "response_format.json_schema.schema"


def test_a_grammar_past_the_limits_is_refused_naming_its_field(tokenizer, monkeypatch):
    monkeypatch.setitem(grammar.LIMITS, "max_grammar_size", 200)
    small = Grammars(tokenizer, VOCAB, (EOS,))
    small.compile(Constraint("choice", choices=("yes", "no")))  # within the limit
    many_keys = {"type": "object", "properties": {f"key{i}": {"type": "string"}
                                                  for i in range(40)}}
    with pytest.raises(ValidationError) as caught:
        small.compile(json_schema(many_keys, "guided_json"))
    assert caught.value.field == "guided_json"
    assert "too big" in str(caught.value)
