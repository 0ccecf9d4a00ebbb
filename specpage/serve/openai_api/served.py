"""What the HTTP API says about the daemon: the names it serves the target
as (vLLM's --served-model-name), the model objects /v1/models lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specpage.serve.openai_api.errors import APIError, ErrorBody


@dataclass(frozen=True)
class Served:
    """What the routes say about the daemon."""

    names: tuple[str, ...]  # the `model` names accepted; the first answers for none
    root: str  # the checkpoint: its path as configured, or its Hugging Face id
    draft: str | None
    max_prompt_tokens: int  # server.max_prompt_tokens, for /tokenize
    created: int = 0  # Unix time the daemon started

    def __post_init__(self) -> None:
        assert self.names, "a daemon serves its model under one name at least"

    def model(self, requested: str | None) -> str:
        """The name a response carries: the one the request gave, or the
        first. An absent or empty name means the model served (vLLM requires
        one; curl users often leave it out); a name not served is 404."""
        if not requested:
            return self.names[0]
        if requested not in self.names:
            served = ", ".join(repr(name) for name in self.names)
            raise APIError(404, ErrorBody(
                f"the model {requested!r} does not exist; this server serves {served}",
                "invalid_request_error", "model", "model_not_found"))
        return requested

    def card(self, name: str, max_context: int | None) -> dict[str, Any]:
        """A model object, as vLLM's /v1/models lists it."""
        return {"id": name, "object": "model", "created": self.created,
                "owned_by": "specpage", "root": self.root, "parent": None,
                "max_model_len": max_context, "metadata": {"draft": self.draft}}
