"""Finding a secret in output, in any form it could print in.

`secret not in text` misses the key that printed as hex, as a bytes repr or as base64
(a dataclass repr shows bytes as b'\\x..', never as hex). Every secret scan in the suite
goes through `leaks`, and so does its positive control: a secret planted in the same
output is found by the same code.
"""

from __future__ import annotations

import base64
import json

Secret = str | bytes

_URLSAFE = str.maketrans("+/", "-_")


def printed_forms(secret: Secret) -> dict[str, str]:
    """The forms `secret` can print in, by name: a text's own characters, its repr and
    JSON escapes; the bytes as they are, as hex (either case), as a bytes repr, as a list
    of ints (Python's or compact JSON's), and as base64 or base64url, also inside a
    longer one."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    forms = {
        "raw bytes": raw.decode("latin-1"),  # as `leaks` reads bytes output
        "hex": raw.hex(),
        "HEX": raw.hex().upper(),
        "bytes repr": repr(raw)[2:-1],
        # a bytearray's repr escapes a ' that a bytes repr leaves bare (it switches quotes)
        "bytearray repr": repr(bytearray(raw))[len("bytearray(b'") : -2],
        # a bytes repr inside a quoted string (JSON, a Prometheus label value): its
        # backslashes and double quotes escaped, the same way in both
        "escaped bytes repr": json.dumps(repr(raw)[2:-1])[1:-1],
        "list of ints": str(list(raw))[1:-1],
        "compact list of ints": ",".join(map(str, raw)),
    }
    if isinstance(secret, str):
        forms |= {"text": secret, "str repr": repr(secret)[1:-1], "JSON": json.dumps(secret)[1:-1]}
    for offset in range(3):  # the 3 ways the secret's bits can align in base64's 6-bit digits
        encoded = base64.b64encode(bytes(offset) + raw).decode()
        # Only the digits made of the secret's bits alone, whatever comes before or after.
        pure = encoded[-(-8 * offset // 6) : 8 * (offset + len(raw)) // 6]
        forms[f"base64 at byte offset {offset}"] = pure
        forms[f"base64url at byte offset {offset}"] = pure.translate(_URLSAFE)
    return forms


def leaks(output: str | bytes, **secrets: Secret) -> dict[str, list[str]]:
    """The forms each of `secrets` is in `output`, by its name; empty when none is there.
    Bytes output is read byte for byte (latin-1), so every form is found in it."""
    text = output.decode("latin-1") if isinstance(output, bytes) else output
    found = {
        name: [form for form, printed in printed_forms(secret).items() if printed in text]
        for name, secret in secrets.items()
    }
    return {name: forms for name, forms in found.items() if forms}
