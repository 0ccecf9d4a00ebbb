"""Server-Sent Events, as OpenAI-compatible servers stream them: lines in, event data out.

Per the HTML living standard's event-stream rules: `data:` lines accumulate (joined
by newlines) until a blank line dispatches the event; lines starting with `:` are
comments (keep-alives); other fields (`event:`, `id:`, `retry:`) carry nothing a
completion stream needs; an event the stream ends inside is never dispatched.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

DONE = "[DONE]"  # the data of the OpenAI stream's last event


async def event_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The data of each complete event, from the stream's lines without their endings."""
    pending: list[str] | None = None
    async for line in lines:
        if not line:
            if pending is not None:
                yield "\n".join(pending)
            pending = None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            pending = pending or []
            pending.append(value.removeprefix(" "))
