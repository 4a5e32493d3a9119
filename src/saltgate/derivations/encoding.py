"""Byte encodings shared by every spec v1 derivation."""

from __future__ import annotations

import base64
import struct

_U32 = struct.Struct(">I")
U32_MAX = 0xFFFF_FFFF


def lp(x: bytes) -> bytes:
    """Length-prefix ``x`` as ``u32be(len(x)) || x``.

    Concatenated fields become unambiguous: ("ab", "c") and ("a", "bc") encode differently.
    """
    if len(x) > U32_MAX:
        raise ValueError("lp: field longer than 2**32 - 1 bytes")
    return _U32.pack(len(x)) + x


def u32be(n: int) -> bytes:
    """Four-byte big-endian unsigned integer (frame headers of the route window)."""
    return _U32.pack(n)


def b64url_nopad(b: bytes) -> str:
    """RFC 4648 section 5 base64url without '=' padding: safe in JSON, URLs and vLLM salts."""
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode("ascii")
