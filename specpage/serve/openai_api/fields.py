"""The unknown-field rule: what a request may carry beyond what is honoured.

A field that would change the output if honoured, and is not, is refused
with a 400 naming it: vLLM's `guided_*` fields other than those honoured,
`logits_processors` and the other fields in REFUSED
whenever they ask for something, a known field at a value the engine cannot
honour (protocol.NEUTRAL), and a top-level field no API we follow defines
(its meaning is unknown, so it may change the output).

A field that changes nothing is accepted: keys we do not know inside a
message, a content part or `stream_options`, and the top-level fields in
IGNORED (the caller's own bookkeeping, hints that change how a server
routes or bills, never what it writes). Each is logged at WARNING the first
time its name is seen in the process, and listed in the response's
IGNORED_HEADER, by name (`messages[].mood`), so a client can see that it
went unread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec

from specpage.core.request import ValidationError

log = logging.getLogger("specpage.http")
IGNORED_HEADER = "X-Ignored-Fields"
# Top-level fields that ask for something we do not do, whatever their value
# other than null, false or empty; a prefix covers vLLM's family of them.
REFUSED_PREFIXES = {"guided_": "this form of constrained decoding is not supported"}
# vLLM's guided_* fields that are honoured (protocol.constraint)
HONOURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
REFUSED = {
    "logits_processors": "logits processors are not supported",
    "allowed_token_ids": "restricting the vocabulary is not supported",
    "bad_words": "banned words are not supported",
    "use_beam_search": "beam search is not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported",
    "continue_final_message": "continuing the final message is not supported",
    "chat_template": "a chat template of the request's own is not supported",
}
# Top-level fields that carry no meaning for generation: accepted and listed
# whatever their value. `tools`/`functions` join them when the call says
# "none" (see protocol.check_supported).
IGNORED = (
    "user",  # the caller's end user, for its own logs
    "metadata",  # kept with stored completions; none are stored
    "store",
    "service_tier",
    "prompt_cache_key",  # OpenAI's routing hint; the prefix cache needs none
    "safety_identifier",
    # vLLM's: how to constrain, which changes nothing unless a guided_* asks
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)


def check_refused(raw: Any) -> None:
    """A ValidationError naming the first top-level field that asks for what
    is not done (see REFUSED)."""
    if not isinstance(raw, dict):
        return  # decoding names the body
    for name, value in raw.items():
        if name in IGNORED or name in HONOURED:
            continue
        reason = REFUSED.get(name) or next(
            (why for prefix, why in REFUSED_PREFIXES.items() if name.startswith(prefix)), None)
        if reason is not None and value not in (None, False, "", [], {}):
            raise ValidationError(name, reason)


def take_ignored(raw: Any, kind: type[msgspec.Struct]) -> list[str]:
    """The IGNORED fields raw gives (not null), taken out of raw where kind
    has no field for them."""
    if not isinstance(raw, dict):
        return []
    known = {field.encode_name for field in msgspec.structs.fields(kind)}
    given = [name for name in IGNORED if raw.get(name) is not None]
    for name in given:
        if name not in known:
            del raw[name]
    return given


def unknown_nested(raw: Any, parts: dict[str, type[msgspec.Struct]]) -> list[str]:
    """The keys of raw's objects that their types do not know, by name:
    `messages[].mood`, `messages[].content[].cache_control`,
    `stream_options.foo`. parts maps "messages", "content" and
    "stream_options" to their types."""
    if not isinstance(raw, dict):
        return []
    found: list[str] = []
    options = raw.get("stream_options")
    if isinstance(options, dict):
        found += _unknown(options, parts["stream_options"], "stream_options.")
    messages = raw.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        found += _unknown(message, parts["messages"], "messages[].")
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict):
                found += _unknown(part, parts["content"], "messages[].content[].")
    return found


def _unknown(value: dict[str, Any], kind: type[msgspec.Struct], prefix: str) -> list[str]:
    known = {field.encode_name for field in msgspec.structs.fields(kind)}
    return [prefix + key for key in value if key not in known]


class IgnoredFields:
    """Logs each ignored field's name at WARNING the first time it is seen
    (one per process: the daemon builds one)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def note(self, names: Iterable[str]) -> list[str]:
        """names, sorted and without repeats, each logged if it is new."""
        listed = sorted(set(names))
        for name in listed:
            if name not in self.seen:
                self.seen.add(name)
                log.warning("request field ignored: it changes nothing here; "
                            "logged once per field name", extra={"field": name})
        return listed
