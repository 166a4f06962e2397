"""The contract between the ingress deployment and a router deployment (one serving unit).

Owns: `GenerateRequest` (tokenized prompt + sampling parameters, and the prompt's block hashes
when the unit caches prefixes, sent through a Serve streaming handle), `GenerateChunk` (what
the router streams back: new token ids, a finish reason, or an `EngineError`) and `ModelInfo`.
Plain dataclasses: they cross process boundaries by pickle, and the ingress can be tested
without Ray.

Streaming protocol: `router.generate.options(stream=True).remote(request)` yields chunks.
The first chunk may be an error (rejected by admission control: 429; no unit: 503; bad
parameters found late: 400) and then the stream ends. Otherwise chunks carry token ids (one
or more per chunk, in order) and the last chunk carries `finish_reason`; every token chunk
carries the prompt's count and how many of its tokens the unit found in its prefix cache. Cancelling the
stream (client disconnect, or a stop string matched at the ingress) aborts the request in the
router and frees its KV blocks.

With `report_load`, the unit's verdict carries its snapshot (`GenerateChunk.load`, the one the
ingress's front-end admission reads): a rejection carries it on its error chunk; an admitted
request first gets a chunk with only the snapshot (no tokens, no finish reason), sent at once,
before the first token. Such a chunk is for the ingress's client and never reaches a renderer.

Prefix hashes: a unit with prefix caching on names its `HashScheme` in `ModelInfo.hash_scheme`;
the ingress hashes each prompt once under it (`GenerateRequest.prompt_hashes`), and the request
router and the unit both read those. A request without them, or with hashes of another scheme
(namespace, block size), is hashed by the unit itself: the hashes are an optimisation, never a
key the unit trusts across namespaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal_core.block_hash import HashScheme, PromptHashes
from tidal_core.request import SamplingParams
from tidal_core.service_class import ServiceClass
from tidal_core.snapshot import UnitLoad


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float  # wall clock (time.time()) when the ingress received the HTTP request
    report_load: bool = False  # the unit attaches its `UnitLoad` to its verdict (see GenerateChunk.load)
    service_class: ServiceClass = ServiceClass.INTERACTIVE  # from service_tier / priority (tidal_core/service_class.py)
    prompt_hashes: PromptHashes | None = None  # the prompt's block hashes, made once by the ingress


@dataclass(frozen=True)
class EngineError:
    """An error to show the client in OpenAI's error schema."""

    status: int  # HTTP status: 400, 429, 503, 500
    type: str  # OpenAI error type: "invalid_request_error", "rate_limit_error", "server_error", ...
    code: str  # stable machine code, e.g. "queue_full", "prefill_backlog", "engine_dead"
    message: str
    retry_after_s: float | None = None

    @classmethod
    def unavailable(cls, code: str, message: str, retry_after_s: float) -> EngineError:
        """A 503 `server_error`: the serving unit failed or is not there yet; the client retries."""
        return cls(503, "server_error", code, message, retry_after_s)


UNIT_REPLACED = "the serving unit failed and is being replaced; retry"


@dataclass
class GenerateChunk:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[list[tuple[int, float]]] | None = None  # one entry per token id, if asked
    num_prompt_tokens: int = 0
    error: EngineError | None = None
    load: UnitLoad | None = None  # with `report_load`: the unit's snapshot right after its admission verdict
    # With `report_load`, on the verdict: how long the request had waited since the front end's
    # arrival (`GenerateRequest.arrival_s`) when the unit received it (the front gates' path model)
    waited_s: float | None = None
    # Prompt tokens whose KV came from the unit's prefix cache (0 until the request is admitted to run)
    num_cached_tokens: int = 0
    # The class that serves the request, on the unit's first chunk of tokens: batch, or interactive
    # (also for a batch request on a unit whose batch class is off); the response's service_tier.
    service_class: ServiceClass | None = None


@dataclass(frozen=True)
class ModelInfo:
    model_id: str  # the name clients pass as `model`
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    backend: str  # "hf" or "sim"
    hash_scheme: HashScheme | None = None  # how the unit hashes prompt blocks; None: no prefix caching
