"""The model a server serves: its name and what requests are checked and rendered with, and
``GET /v1/models``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from hydragen.server.engine_client import EngineClient
from hydragen.server.errors import APIError


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer knows of the model: the same for every rebuild of its engine (the same files)."""

    name: str  # what requests name in "model"
    tokenizer: Any  # None for a model without tokenizer files (token-id prompts only)
    tool_format: Any  # hydragen.tools.formats.CallFormat, resolved from the chat template
    context: int  # max_position_embeddings
    vocab_size: int
    # The model's sampling defaults for fields a request leaves unset (LLM.generation_defaults).
    sampling_defaults: dict = field(default_factory=dict)

    @classmethod
    def of(cls, llm, name: str) -> ServedModel:
        c = llm.config
        defaults = dict(llm.generation_defaults.values) if hasattr(llm, "generation_defaults") else {}
        return cls(name, llm.tokenizer, llm.tool_format, c.max_position_embeddings, c.vocab_size, defaults)

    def check(self, requested: str) -> None:
        """404 ``model_not_found`` for a request naming another model."""
        if requested != self.name:
            raise APIError(
                404,
                f"model {requested!r} does not exist; this server serves {self.name!r}",
                "model",
                code="model_not_found",
            )


def add_models_route(app: FastAPI, client: EngineClient, model: ServedModel) -> None:
    @app.get("/v1/models")
    async def models():
        card = {"id": model.name, "object": "model", "created": int(client.started), "owned_by": "hydragen"}
        return {"object": "list", "data": [card]}
