"""vLLM's /tokenize and /detokenize, for clients that count or cut tokens
with the server's own tokenizer (evaluation harnesses, proxies).

POST /tokenize takes a prompt ({model?, prompt, add_special_tokens=true})
or a conversation ({model?, messages, add_generation_prompt=true,
add_special_tokens=false, chat_template_kwargs?}) and answers {count,
max_model_len, tokens, token_strs}; POST /detokenize takes {model?, tokens}
and answers {prompt}. Both tokenize on the front end's own threads
(Frontend.off_loop), never on the event loop.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from specpage.core.chat_template import TemplateOptions
from specpage.core.request import ValidationError
from specpage.engine.submission import ChatPrompt, TextPrompt, token_ids
from specpage.serve.frontend import Frontend
from specpage.serve.openai_api import protocol, tools
from specpage.serve.openai_api.fields import IGNORED_HEADER, IgnoredFields
from specpage.serve.openai_api.served import Served


class TokenizeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """vLLM's two shapes in one: a prompt, or messages with the chat fields."""

    model: str | None = None
    prompt: str | None = None
    messages: list[protocol.Message] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # None: true
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValidationError("prompt", "give prompt or messages, one of the two")
        if self.messages is None:
            chat_only = ("add_generation_prompt", "chat_template_kwargs")
            given = next((name for name in chat_only if getattr(self, name) is not None), None)
            if given is not None:
                raise ValidationError(given, "only with messages")


class DetokenizeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True,
                        kw_only=True):
    model: str | None = None
    tokens: list[int]


class TokenizeRoutes:
    """The two routes, on the daemon's tokenizer; the served names and the
    ignored fields' log are OpenAIRoutes'."""

    def __init__(self, frontend: Frontend, served: Served, ignored: IgnoredFields) -> None:
        self.frontend = frontend
        self.served = served
        self.ignored = ignored

    async def tokenize(self, request: Request) -> Response:
        self.frontend.check_open()
        body, ignored = protocol.decode(await request.body(), TokenizeRequest)
        self.served.model(body.model)
        body.check()
        engine = self.frontend.engine
        tokenizer, limit = engine.tokenizer, self.served.max_prompt_tokens
        if body.messages is not None:
            options = TemplateOptions(
                add_generation_prompt=body.add_generation_prompt is not False,
                add_special_tokens=bool(body.add_special_tokens),
                variables=body.chat_template_kwargs or {})
            messages = protocol.chat_messages(body.messages)
            tools.check_messages(messages, tokenizer)
            chat = ChatPrompt(tools.tool_messages(messages), options)
            ids = await self.frontend.off_loop(
                lambda: token_ids(tokenizer, chat, "messages", limit))
        else:
            text = TextPrompt(body.prompt or "")
            special = body.add_special_tokens is not False
            ids = await self.frontend.off_loop(
                lambda: token_ids(tokenizer, text, "prompt", limit, special))
        strings = None
        if body.return_token_strs:
            strings = await self.frontend.off_loop(lambda: tokenizer.convert_ids_to_tokens(ids))
        answer = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids,
                  "token_strs": strings}
        return self._json(answer, ignored)

    async def detokenize(self, request: Request) -> Response:
        self.frontend.check_open()
        body, ignored = protocol.decode(await request.body(), DetokenizeRequest)
        self.served.model(body.model)
        tokenizer = self.frontend.engine.tokenizer
        text = await self.frontend.off_loop(lambda: _decode(tokenizer, body.tokens))
        return self._json({"prompt": text}, ignored)

    def _json(self, answer: dict[str, Any], ignored: list[str]) -> Response:
        headers = {IGNORED_HEADER: ", ".join(self.ignored.note(ignored))} if ignored else None
        return Response(msgspec.json.encode(answer), 200, headers,
                        media_type="application/json")


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    """tokens as text, each checked to be in the vocabulary (a long list
    takes a while: not on the event loop)."""
    if tokenizer is None:
        raise ValidationError("tokens", "the model has no tokenizer")
    vocabulary = len(tokenizer)
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocabulary), None)
    if bad is not None:
        raise ValidationError(f"tokens[{bad}]", f"token id {tokens[bad]} outside "
                              f"0..{vocabulary - 1}")
    return str(tokenizer.decode(tokens))
