"""Spec v1: the byte-exact derivations every saltgate instance must agree on.

Pure: no I/O, no clocks. Pinned by test vectors from an independent implementation
(tests/derivations/) and described for other implementations in docs/spec.md.
"""

from saltgate.derivations.derive import (
    DEFAULT_MIN_PROMPT_BYTES,
    DEFAULT_WINDOW_BYTES,
    SECRET_MAX_CHARS,
    SECRET_MIN_CHARS,
    InvalidSecretError,
    SubKeys,
    cache_salt,
    derive_subkeys,
    media_uuid,
    prompt_size,
    route_key,
    route_window,
    validate_user_cache_secret,
)
from saltgate.derivations.encoding import b64url_nopad, lp

__all__ = [
    "DEFAULT_MIN_PROMPT_BYTES",
    "DEFAULT_WINDOW_BYTES",
    "SECRET_MAX_CHARS",
    "SECRET_MIN_CHARS",
    "InvalidSecretError",
    "SubKeys",
    "b64url_nopad",
    "cache_salt",
    "derive_subkeys",
    "lp",
    "media_uuid",
    "prompt_size",
    "route_key",
    "route_window",
    "validate_user_cache_secret",
]
