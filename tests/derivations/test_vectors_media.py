"""The media uuid (docs/spec.md section 12) pinned against the independent implementation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from saltgate.derivations import media_uuid

from . import make_media_vectors
from . import reference as ref

pytestmark = pytest.mark.unit

VECTORS: dict[str, Any] = json.loads(
    Path(__file__).with_name("vectors_media_v1.json").read_text(encoding="utf-8")
)
UUID_RE = re.compile(r"^sg1m_[A-Za-z0-9_-]{43}$")


def test_stored_media_uuids() -> None:
    cases = VECTORS["media_uuids"]
    assert len(cases) == len(make_media_vectors.MEDIA_INPUTS)
    for v in cases:
        got = media_uuid(v["cache_salt"], v["modality"], v["media"].encode())
        assert got == v["uuid"]
        assert UUID_RE.match(got)


def test_stored_vectors_are_the_reference_s() -> None:
    assert make_media_vectors.build()["media_uuids"] == VECTORS["media_uuids"]


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 100_000])
def test_matches_reference_at_every_size(size: int) -> None:
    media = bytes(i % 251 for i in range(size))
    salt = "sg1_" + "x" * 43
    assert media_uuid(salt, "image", media) == ref.media_uuid(salt, "image", media)


def test_every_input_moves_the_uuid() -> None:
    base = media_uuid("sg1_a", "image", b"data:x")
    assert media_uuid("sg1_b", "image", b"data:x") != base  # another namespace
    assert media_uuid("sg1_a", "video", b"data:x") != base  # another modality
    assert media_uuid("sg1_a", "image", b"data:y") != base  # other media
    # length prefixes: moving a byte between modality and media changes the input
    assert media_uuid("sg1_a", "imag", b"edata:x") != base


def test_refuses_an_empty_salt() -> None:
    with pytest.raises(ValueError, match="salt"):
        media_uuid("", "image", b"x")
