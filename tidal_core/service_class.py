"""Service classes: interactive (held to the SLO) and batch (deferrable, fills the headroom).

Owns: `ServiceClass` and the one mapping from the API's fields to it, so the HTTP edge and
every driver read a request's class the same way:

- OpenAI's `service_tier`: "flex" is batch; "default" and "auto" (and absent) are interactive;
  any other value is a bad request;
- vLLM's integer `priority` (lower value first): a value above 0 is batch, 0 or below (and
  absent) is interactive. When both are given, `service_tier` decides.

A response names its class with `tier_name`: "flex" for batch, "default" for interactive, as
OpenAI's `service_tier` response field does.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import enum

SERVICE_TIERS = ("auto", "default", "flex")
"""The `service_tier` request values accepted."""


class ServiceClass(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def tier_name(self) -> str:
        """The OpenAI `service_tier` a response reports for this class."""
        return "flex" if self is ServiceClass.BATCH else "default"


def service_class_of(service_tier: str | None = None, priority: int | None = None) -> ServiceClass:
    """The class a request's `service_tier` / `priority` ask for; ValueError (a 400 at the
    edge) for a tier that is not one of `SERVICE_TIERS` or a priority that is not an integer."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority={priority!r} must be an integer (above 0: batch class; 0 or below: interactive)")
    if service_tier is not None:
        if service_tier not in SERVICE_TIERS:
            raise ValueError(f"service_tier={service_tier!r} is not supported; use one of "
                             f"{', '.join(repr(t) for t in SERVICE_TIERS)} ('flex' = batch class)")
        return ServiceClass.BATCH if service_tier == "flex" else ServiceClass.INTERACTIVE
    return ServiceClass.BATCH if priority is not None and priority > 0 else ServiceClass.INTERACTIVE
