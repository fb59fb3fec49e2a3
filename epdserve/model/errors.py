"""Errors a request can fail with because of what it asked for (map to INVALID_ARGUMENT)."""


class InvalidRequestError(ValueError):
    """The request itself is bad (corrupt media, placeholder mismatch, too long, bad params)."""
