"""An independent implementation of spec v1, written from docs/spec.md, for test vectors.

Shares no code with saltgate.derivations: HMAC is built from hashlib (RFC 2104), HKDF by hand
(RFC 5869), framing with struct, canonical JSON by a small serialiser of its own (not
orjson). It favours plainness over speed: build every piece in full, then cut.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from typing import Any

BLOCK = 64  # SHA-256 block size


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
    if len(key) > BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(BLOCK, b"\x00")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in key) + msg).digest()
    return hashlib.sha256(bytes(b ^ 0x5C for b in key) + inner).digest()


def hkdf_sha256(ikm: bytes, info: bytes, length: int, salt: bytes = b"") -> bytes:
    prk = hmac_sha256(salt or b"\x00" * 32, ikm)  # RFC 5869 2.2: no salt = HashLen zeros
    okm, block, counter = b"", b"", 1
    while len(okm) < length:
        block = hmac_sha256(prk, block + info + bytes([counter]))
        okm += block
        counter += 1
    return okm[:length]


def lp(x: bytes) -> bytes:
    return struct.pack(">I", len(x)) + x


def subkeys(master: bytes) -> dict[str, bytes]:
    return {
        "salt": hkdf_sha256(master, b"saltgate/v1/salt", 32),
        "route": hkdf_sha256(master, b"saltgate/v1/route", 32),
        "kv_events": hkdf_sha256(master, b"saltgate/v1/kv-events", 32),
    }


def cache_salt(k_salt: bytes, tenant: str, epoch: str, secret: str | None) -> str:
    msg = b"saltgate/v1/cache-salt"
    msg += lp(b"user" if secret else b"tenant")
    msg += lp(tenant.encode()) + lp(epoch.encode())
    if secret:
        msg += lp(secret.encode())
    mac = hmac_sha256(k_salt, msg)
    return "sg1_" + base64.urlsafe_b64encode(mac).decode().replace("=", "")


def route_key(k_route: bytes, model: str, salt: str, window: bytes) -> bytes:
    return hmac_sha256(
        k_route, b"saltgate/v1/route" + lp(model.encode()) + lp(salt.encode()) + lp(window)
    )


# -- canonical JSON (docs/spec.md, "Canonical JSON") ------------------------------------


def format_float(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        raise ValueError("not representable")
    if x == 0:
        return "-0.0" if math.copysign(1, x) < 0 else "0.0"
    digits, exp = _shortest(x)
    sign = "-" if x < 0 else ""
    # exp: the decimal exponent of the first digit (x = d.ddd * 10**exp)
    if -5 <= exp < 16:
        if exp >= 0:
            intpart = digits[: exp + 1].ljust(exp + 1, "0")
            frac = digits[exp + 1 :] or "0"
            return f"{sign}{intpart}.{frac}"
        return f"{sign}0.{'0' * (-exp - 1)}{digits}"
    mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{mant}e{'+' if exp > 0 else '-'}{abs(exp)}"


def _shortest(x: float) -> tuple[str, int]:
    """Shortest round-trip significant digits and exponent, via repr's digits."""
    mantissa, _, e = f"{abs(x):.17e}".partition("e")
    for n in range(1, 18):
        cand = f"{abs(x):.{n - 1}e}"
        if float(cand) == abs(x):
            mantissa, _, e = cand.partition("e")
            break
    digits = mantissa.replace(".", "").rstrip("0") or "0"
    return digits, int(e)


def canonical_json(v: Any) -> str:  # noqa: PLR0911 - one return per JSON type
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ",".join(canonical_json(e) for e in v) + "]"
    if isinstance(v, dict):
        items = sorted(v.items())
        return "{" + ",".join(f"{canonical_json(k)}:{canonical_json(e)}" for k, e in items) + "}"
    raise TypeError(type(v))


# -- route window (docs/spec.md, "Route window") -----------------------------------------


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _lead(messages: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        if m.get("role") in ("system", "developer"):
            out.append(("S", m.get("content")))
        elif m.get("role") == "user":
            out.append(("U", m.get("content")))
            break
    return out


def _tokens(ids: list[Any]) -> bytes:
    good: list[int] = []
    for t in ids:
        if type(t) is not int:
            break
        good.append(t)
    return ",".join(map(str, good)).encode()


def pieces(body: dict[str, Any], route: str) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    pck = body.get("prompt_cache_key")
    if isinstance(pck, str) and pck:
        out.append(("K", pck.encode()))
    tools = body.get("tools")
    if tools is not None and tools != []:
        out.append(("T", canonical_json(tools).encode()))
    raw: list[tuple[str, Any]] = []
    if route == "/v1/chat/completions":
        raw = _lead(body.get("messages"))
    elif route == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, str):
            out.append(("P", p.encode()))
        elif isinstance(p, list) and p:
            if type(p[0]) is int:
                out.append(("I", _tokens(p)))
            elif isinstance(p[0], str):
                out.append(("P", p[0].encode()))
            elif isinstance(p[0], list):
                out.append(("I", _tokens(p[0])))
    elif route == "/v1/responses":
        if isinstance(body.get("instructions"), str):
            raw.append(("S", body["instructions"]))
        inp = body.get("input")
        raw += [("U", inp)] if isinstance(inp, str) else _lead(inp)
    elif route == "/v1/messages":
        if body.get("system") is not None:
            raw.append(("S", body["system"]))
        raw += _lead(body.get("messages"))
    out += [(tag, (_text(c) or "").encode()) for tag, c in raw]
    return out


def window(body: dict[str, Any], route: str, w: int = 1024, floor: int = 4096) -> bytes | None:
    pck = body.get("prompt_cache_key")
    if not (isinstance(pck, str) and pck) and prompt_size(body, route) < floor:
        return None
    buf = b""
    for tag, data in pieces(body, route):
        room = w - len(buf) - 5
        if room <= 0:
            break
        cut = data[:room]
        buf += tag.encode() + struct.pack(">I", len(cut)) + cut
    return buf


def prompt_size(body: dict[str, Any], route: str) -> int:
    tools = body.get("tools")
    n = len(canonical_json(tools).encode()) if tools is not None and tools != [] else 0
    texts: list[Any] = []
    if route in ("/v1/chat/completions", "/v1/messages"):
        if route == "/v1/messages":
            texts.append(body.get("system"))
        msgs = body.get("messages")
        texts += (
            [m.get("content") for m in msgs if isinstance(m, dict)]
            if isinstance(msgs, list)
            else []
        )
    elif route == "/v1/responses":
        texts.append(
            body.get("instructions") if isinstance(body.get("instructions"), str) else None
        )
        inp = body.get("input")
        if isinstance(inp, str):
            texts.append(inp)
        elif isinstance(inp, list):
            texts += [i.get("content") for i in inp if isinstance(i, dict)]
    elif route == "/v1/completions":
        for tag, data in pieces({"prompt": body.get("prompt")}, route):
            n += len(data) if tag == "P" else 4 * (data.count(b",") + 1 if data else 0)
        return n
    return n + sum(len((_text(t) or "").encode()) for t in texts if t is not None)


# -- prefix digests (docs/spec.md, "Prefix digests") --------------------------------------


def prefix_digests(k_route: bytes, model: str, salt: str, flat: bytes, first: int) -> list[bytes]:
    out = []
    depth = first
    while depth <= len(flat):
        msg = b"saltgate/v1/prefix" + lp(k_route) + lp(model.encode()) + lp(salt.encode())
        out.append(hashlib.sha256(msg + flat[:depth]).digest())
        depth *= 2
    return out


# -- replica ranking (docs/spec.md, "Replica ranking") ------------------------------------


def rendezvous_score(key: bytes, member_id: str, weight: float) -> float:
    digest = hashlib.sha256(b"saltgate/v1/rendezvous" + lp(key) + lp(member_id.encode())).digest()
    x = int.from_bytes(digest[:8], "big") >> 12  # the first 52 bits
    u = (2 * x + 1) / 2**53
    return weight / -math.log(u)


def rank(key: bytes, members: list[tuple[str, float]]) -> list[str]:
    scored = [(-rendezvous_score(key, mid, w), mid) for mid, w in members]
    return [mid for _, mid in sorted(scored)]


# -- KV relay (docs/spec.md, "KV relay") -------------------------------------------------

P25519 = 2**255 - 19
Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def kv_block_hash(k_kv: bytes, block_hash: int) -> int:
    mac = hmac_sha256(k_kv, b"saltgate/v1/kv-block" + struct.pack(">Q", block_hash))
    return int(struct.unpack(">Q", mac[:8])[0])


def kv_replica_id(k_kv: bytes, name: str) -> str:
    return "replica-" + hmac_sha256(k_kv, b"saltgate/v1/kv-replica" + lp(name.encode())).hex()[:16]


def x25519(scalar: bytes, u: bytes) -> bytes:
    """RFC 7748 section 5: the Montgomery ladder, as written there."""
    k = bytearray(scalar)
    k[0] &= 248
    k[31] &= 127
    k[31] |= 64
    k_int = int.from_bytes(k, "little")
    x1 = int.from_bytes(u, "little") & ((1 << 255) - 1)
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    for t in reversed(range(255)):
        bit = (k_int >> t) & 1
        if swap ^ bit:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = x2 + z2, x2 - z2
        c, d = x3 + z3, x3 - z3
        aa, bb = a * a % P25519, b * b % P25519
        e = (aa - bb) % P25519
        da, cb = d * a % P25519, c * b % P25519
        x3 = (da + cb) ** 2 % P25519
        z3 = x1 * (da - cb) ** 2 % P25519
        x2 = aa * bb % P25519
        z2 = e * (aa + 121665 * e) % P25519
    if swap:
        x2, z2 = x3, z3
    return (x2 * pow(z2, P25519 - 2, P25519) % P25519).to_bytes(32, "little")


def z85(data: bytes) -> str:
    """ZeroMQ RFC 32: every 4 bytes (big-endian) as 5 base-85 digits, most significant first."""
    out = []
    for i in range(0, len(data), 4):
        n = int.from_bytes(data[i : i + 4], "big")
        out += [Z85_ALPHABET[n // 85**p % 85] for p in range(4, -1, -1)]
    return "".join(out)


def kv_relay_public_key(k_kv: bytes) -> str:
    secret = hkdf_sha256(k_kv, b"saltgate/v1/kv-relay-curve", 32)
    return z85(x25519(secret, (9).to_bytes(32, "little")))


def cluster_bus(k_route: bytes) -> tuple[bytes, str]:
    """K_bus and the stream's name (section 11)."""
    bus = hkdf_sha256(k_route, b"saltgate/v1/cluster-bus", 32)
    return bus, "saltgate-cluster-" + hmac_sha256(bus, b"saltgate/v1/cluster-stream")[:8].hex()


def cluster_tag(k_bus: bytes, payload: bytes) -> bytes:
    return hmac_sha256(k_bus, b"saltgate/v1/cluster-batch" + payload)[:16]


def media_uuid(salt: str, modality: str, media: bytes) -> str:
    """docs/spec.md section 12: the uuid set on a media content part."""
    msg = b"saltgate/v1/media-uuid" + lp(modality.encode()) + lp(media)
    mac = hmac_sha256(salt.encode(), msg)
    return "sg1m_" + base64.urlsafe_b64encode(mac).decode().replace("=", "")


# -- audit log (docs/spec.md, "Audit log key and chain") ---------------------------------

_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\b": "\\b",
    "\f": "\\f",
}


def _ascii_json_string(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif code < 0x20 or 0x7F < code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        elif code > 0xFFFF:  # a UTF-16 surrogate pair
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def audit_fields_json(fields: list[Any]) -> bytes:
    """The entry's fields as the spec encodes them: a JSON array, no spaces, ASCII only,
    integers in decimal, the time as the shortest decimal that reads back to it with at
    least one digit after the point."""
    parts = []
    for v in fields:
        if v is None:
            parts.append("null")
        elif isinstance(v, bool):
            raise TypeError("no booleans in an entry")
        elif isinstance(v, int):
            parts.append(str(v))
        elif isinstance(v, float):
            parts.append(repr(v))
        else:
            parts.append(_ascii_json_string(v))
    return ("[" + ",".join(parts) + "]").encode("ascii")


def audit_key(master: bytes) -> bytes:
    return hkdf_sha256(master, b"saltgate/v1/audit-log", 32)


def audit_entry_hash(k_audit: bytes, prev: bytes, fields: list[Any]) -> bytes:
    return hmac_sha256(k_audit, prev + audit_fields_json(fields))
