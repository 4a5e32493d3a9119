"""Regenerate tests/derivations/vectors_media_v1.json from the INDEPENDENT implementation.

    .venv/bin/python -m tests.derivations.make_media_vectors

Only on a deliberate spec change (docs/spec.md section 12): the file pins media_uuid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import reference as ref
from .cases import MASTER_KEYS

OUT = Path(__file__).with_name("vectors_media_v1.json")

# (tenant, user_cache_secret, modality, media): salts of two tenants and a user namespace,
# every modality, an empty and a long media, a non-ASCII media type.
MEDIA_INPUTS: list[tuple[str, str | None, str, str]] = [
    ("tenant-a", None, "image", "data:image/png;base64,iVBORw0KGgo="),
    ("tenant-b", None, "image", "data:image/png;base64,iVBORw0KGgo="),
    ("tenant-a", "s" * 32, "image", "data:image/png;base64,iVBORw0KGgo="),
    ("tenant-a", None, "video", "data:image/png;base64,iVBORw0KGgo="),
    ("tenant-a", None, "audio", "data:audio/wav;base64,UklGRg=="),
    ("tenant-a", None, "image", ""),
    ("tenant-a", None, "image", "data:image/jpeg;base64," + "A" * 5000),
    ("tenant-a", None, "image", "data:image/\u00e9;base64,AA=="),
]


def build() -> dict[str, Any]:
    k_salt = ref.subkeys(MASTER_KEYS[0])["salt"]
    cases = []
    for tenant, secret, modality, media in MEDIA_INPUTS:
        salt = ref.cache_salt(k_salt, tenant, "0", secret)
        cases.append(
            {
                "cache_salt": salt,
                "modality": modality,
                "media": media,
                "uuid": ref.media_uuid(salt, modality, media.encode()),
            }
        )
    return {
        "note": "spec v1 media uuids (docs/spec.md 12) computed by tests/derivations/"
        "reference.py, not by saltgate; regenerate with "
        "`python -m tests.derivations.make_media_vectors` only on a deliberate spec change.",
        "media_uuids": cases,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
