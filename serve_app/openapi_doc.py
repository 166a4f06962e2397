"""The OpenAPI schema the Ingress publishes at /openapi.json.

Owns: `document_openapi(app)`: FastAPI documents a 422 for every body, but the server answers
validation errors with OpenAI's 400 (serve_app/openai/validation.py), so the 422 and its schemas
are dropped; with API keys configured the bearer scheme and the 401 are declared
(serve_app/auth.py, `document_auth`).

Must not import: torch, ray.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from serve_app.auth import document_auth


def document_openapi(app: FastAPI) -> None:
    """FastAPI documents 422 for every body; our validation errors are OpenAI's 400. With API keys
    configured, the schema also declares the bearer scheme and the 401 (serve_app/auth.py)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            if (gate := getattr(app.state, "auth_gate", None)) is not None:
                document_auth(schema, gate, "#/components/schemas/ErrorResponse")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
