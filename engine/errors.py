"""Typed errors the engine raises; services map them to gRPC status codes and HTTP statuses."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT / HTTP 400)."""


class CapacityError(EngineError):
    """The engine cannot take the request now (maps to RESOURCE_EXHAUSTED / HTTP 503)."""


class UnsupportedModelError(EngineError, ValueError):
    """The checkpoint's architecture or format is not supported, or a file is missing."""
