"""Request validation messages: shape checks for union-typed fields and pydantic errors -> one
OpenAI error.

Owns: the "before" validators of `serve_app.openai.requests` (prompt, stop, message role/content):
each raises one error whose message says what the field may hold; without them pydantic reports one error per
union member ("prompt.str: ...; prompt.list[int]: ..."), naming types instead of the mistake. And
`format_validation_errors`, which turns pydantic's (or FastAPI's) error list into one message that
names the parameter, plus the `param` path and a machine `code`.

Must not import: ray, torch, transformers, fastapi, tidal_core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any number. Each one costs a scan per token.


def _error(error_type: str, message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError(error_type, message, ctx or None)


def _text(value: str, what: str) -> str:
    """JSON may carry lone surrogates (\\ud800); they are not text and no tokenizer can encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _error("invalid_value", "{what} must be valid Unicode text (it holds a lone surrogate)",
                     what=what) from None
    return value


def is_json_integer(value: Any) -> bool:
    """JSON has one number type: 16.0 is the integer 16 (JSON Schema says so, and clients in
    typed languages may send it); 16.5, "16" and true (bool is an int subclass) are not."""
    return type(value) is int or (type(value) is float and value.is_integer())


def _ids(values: list[Any]) -> list[int]:
    return [int(v) for v in values]


MAX_PROMPTS = 64
"""Prompts in one /v1/completions request (each is served as its own request, `n` choices each)."""


def check_prompt(value: Any) -> Any:
    shape = ("prompt must be a string, a list of strings, a list of token ids, "
             "or a list of lists of token ids")
    if isinstance(value, str):
        if not value:
            raise _error("invalid_value", "prompt must not be empty")
        return _text(value, "prompt")
    if not isinstance(value, list):
        raise _error("invalid_type", shape)
    if not value:
        raise _error("invalid_value", "prompt must not be empty")
    if all(is_json_integer(t) for t in value):
        return _ids(value)
    if all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value):
        if len(value) > MAX_PROMPTS:
            raise _error("invalid_value", "prompt holds {n} prompts; at most {most} fit in one request",
                         n=len(value), most=MAX_PROMPTS)
        out: list[Any] = []
        for i, inner in enumerate(value):
            where = f"prompt[{i}]" if len(value) > 1 else "prompt"
            if not inner:
                raise _error("invalid_value", "{where} must not be empty", where=where)
            if isinstance(inner, list):
                if not all(is_json_integer(t) for t in inner):
                    raise _error("invalid_type", "{where}: token ids must be integers", where=where)
                out.append(_ids(inner))
            else:
                out.append(_text(inner, where))
        return out
    raise _error("invalid_type", shape)


def check_stop(value: Any) -> Any:
    if value is None:
        return value
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _error("invalid_type", "stop must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise _error("invalid_value", "stop holds {n} strings; at most {max} are allowed", n=len(items),
                     max=MAX_STOP_STRINGS)
    if any(not s for s in items):
        raise _error("invalid_value", "stop strings must not be empty")
    for item in items:
        _text(item, "stop")
    return value


def check_role(value: Any) -> Any:
    if value in ("tool", "function"):
        raise _error("unsupported_value", "role '{role}' is not supported: tool calling is not implemented",
                     role=value)
    return value


def check_content(value: Any) -> Any:
    if value is None:
        raise _error("invalid_value", "content is required (assistant tool calls are not supported)")
    if isinstance(value, str):
        return _text(value, "content")
    if not isinstance(value, list):
        raise _error("invalid_type", "content must be a string or a list of content parts")
    for part in value:
        if not isinstance(part, dict):
            raise _error("invalid_type", "each content part must be an object like {'type': 'text', 'text': ...}")
        kind = part.get("type")
        if kind != "text":
            raise _error("unsupported_value", "content part type {kind} is not supported; only 'text'",
                         kind=repr(kind))
        if isinstance(part.get("text"), str):
            _text(part["text"], "content")
    return value


# ---- validation errors -> one OpenAI error -----------------------------------------------------

# pydantic puts the union member it tried into `loc` ("str", "list[int]", "function-after[...]");
# those are not parameter names.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: Sequence[int | str]) -> str | None:
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or "-" in part:
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None, str]:
    """(message, param, code) for a pydantic / FastAPI error list; names the first bad parameter."""
    if not errors:
        return "Invalid request body.", None, "invalid_request"
    first = errors[0]
    kind = str(first.get("type", "invalid_value"))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "could not parse")
        loc = first.get("loc", ())
        # json's own message may already end in "at" ("Invalid control character at"): no "at at".
        where = ((" position" if str(detail).rstrip().endswith(" at") else " at position") + f" {loc[-1]}"
                 if loc and isinstance(loc[-1], int) else "")
        return f"Malformed JSON in the request body: {detail}{where}.", None, "invalid_json"
    messages = []
    for err in errors[:3]:
        param = _param_path(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "missing":
            messages.append(f"Missing required parameter '{param}'." if param else "Missing request body.")
        elif param:
            got = f" (got {_short_repr(err['input'])})" if "input" in err and err.get("type") != "unsupported_value" \
                else ""
            messages.append(f"Invalid '{param}': {msg}{got}.")
        else:
            messages.append(f"Invalid request body: {msg}.")
    if len(errors) > 3:
        messages.append(f"({len(errors) - 3} more errors)")
    return " ".join(messages), _param_path(first.get("loc", ())), kind
