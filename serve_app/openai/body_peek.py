"""Which service class a request asks for, read at the front door before the app parses the body.

Owns: `peek_service_class` (the body read ahead of the app, replayed to it unchanged, and the class
it asks for) and `asks_for_batch`.

The front gates (serve_app/front_gate.py, serve_app/proxy_gate.py) judge a request before FastAPI
reads it, by the interactive class's rules: its predicted time to first token against the target.
A batch-class request (`service_tier="flex"`, or a `priority` above 0: tidal_core/service_class.py)
is never held to that target; its unit admits it while its batch queue has room. Judged as
interactive at the door, a nightly backlog sent at once was refused there with `prefill_backlog`
(248 of 300), and each refusal, passed on to a unit as interactive demand, scaled the fleet up for a
backlog (benchmarks/RESULTS.md, "The batch class at the door"). So the gates read the body first:
it is already in the server's memory, a substring test finds the two keys, and only a body that
names one is parsed. A body past `limit` bytes, or sent without a Content-Length, is not read
here: the door judges it as interactive, and if it lets it through, its unit serves it as batch.

Must not import: ray, torch, transformers.
"""

from __future__ import annotations

import collections
import json

from starlette.types import Message, Receive

from tidal_core.service_class import ServiceClass, service_class_of

_KEYS = (b'"service_tier"', b'"priority"')


def asks_for_batch(body: bytes) -> bool:
    """The JSON body asks for the batch class (a malformed body or a bad tier: False; the app answers 400)."""
    if not any(key in body for key in _KEYS):
        return False
    try:
        data = json.loads(body)
        return isinstance(data, dict) and service_class_of(data.get("service_tier"),
                                                           data.get("priority")) is ServiceClass.BATCH
    except (ValueError, RecursionError):  # not JSON (or nested past the parser), or a tier the app refuses (400)
        return False


async def peek_service_class(receive: Receive, content_length: str, limit: int) -> tuple[Receive, ServiceClass]:
    """The body of a request of `content_length` bytes read ahead (up to `limit`), a `receive` that
    hands the app the same messages, and the class the body asks for."""
    if not content_length.isdigit() or int(content_length) > limit:
        return receive, ServiceClass.INTERACTIVE
    messages: collections.deque[Message] = collections.deque()
    body = bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":  # a disconnect: the app sees it in its turn
            break
        body += message.get("body", b"")
        if not message.get("more_body", False) or len(body) > limit:
            break

    async def replay() -> Message:
        return messages.popleft() if messages else await receive()

    batch = asks_for_batch(bytes(body))
    return replay, ServiceClass.BATCH if batch else ServiceClass.INTERACTIVE
