"""Typed errors the engine raises; services map them to gRPC status codes and HTTP statuses."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's errors. ``status`` names the gRPC status code a service maps it to."""

    status = "INTERNAL"


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT / HTTP 400)."""

    status = "INVALID_ARGUMENT"


class CapacityError(EngineError):
    """The engine cannot take the request now (maps to RESOURCE_EXHAUSTED / HTTP 503)."""

    status = "RESOURCE_EXHAUSTED"


class UnsupportedModelError(EngineError, ValueError):
    """The checkpoint's architecture or format is not supported, or a file is missing."""

    status = "FAILED_PRECONDITION"
