"""Every label spec v1 feeds into a key derivation or a digest, in one place.

Each purpose has its own ASCII label, so no two derivations ever hash the same input
under the same key. The labels are part of the spec (docs/spec.md, "Labels"): every
gateway and relay of a cluster must use the same ones, and the vectors in tests/derivations/
fail when one changes. Changing a label moves every tenant to a cold namespace or
re-homes every key it feeds: bump ``v1`` in all of them instead.
"""

from __future__ import annotations

from typing import Final

# HKDF-SHA256 info of the three sub-keys of the master key (section 1).
LABEL_SALT_KEY: Final = b"saltgate/v1/salt"
LABEL_ROUTE_KEY: Final = b"saltgate/v1/route"
LABEL_KV_EVENTS_KEY: Final = b"saltgate/v1/kv-events"

# Domains of the keyed hashes under those sub-keys.
CACHE_SALT_DOMAIN: Final = b"saltgate/v1/cache-salt"  # the cache salt, under K_salt
ROUTE_DOMAIN: Final = b"saltgate/v1/route"  # the route key, under K_route
PREFIX_DOMAIN: Final = b"saltgate/v1/prefix"  # prefix-affinity digests, keyed by K_route
RENDEZVOUS_DOMAIN: Final = b"saltgate/v1/rendezvous"  # replica scores for a route key
KV_BLOCK_DOMAIN: Final = b"saltgate/v1/kv-block"  # relayed block hashes, under K_kv
KV_REPLICA_DOMAIN: Final = b"saltgate/v1/kv-replica"  # relayed replica ids, under K_kv
KV_CURVE_LABEL: Final = b"saltgate/v1/kv-relay-curve"  # HKDF info of the relay's CURVE key
# The cluster bus between gateways (section 11): its key from K_route, its stream's name,
# and the domain of the tag on every batch.
LABEL_CLUSTER_BUS_KEY: Final = b"saltgate/v1/cluster-bus"
CLUSTER_STREAM_DOMAIN: Final = b"saltgate/v1/cluster-stream"
CLUSTER_BATCH_DOMAIN: Final = b"saltgate/v1/cluster-batch"
# The uuid set on each multimodal content part (section 12): keyed by the cache salt.
MEDIA_UUID_DOMAIN: Final = b"saltgate/v1/media-uuid"

# The audit log's HMAC key from the master key (section 13): the chain is keyed by what
# the database does not hold.
LABEL_AUDIT_KEY: Final = b"saltgate/v1/audit-log"

# What every derived cache salt starts with ("sg" + the spec version).
SALT_PREFIX: Final = "sg1_"
# What every media uuid starts with ("sg1" + "m" for media).
MEDIA_UUID_PREFIX: Final = "sg1m_"
