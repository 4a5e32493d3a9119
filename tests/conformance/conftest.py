"""The session's real vLLM replicas and gateway tenants (tests/conformance/fleet.py)."""

from tests.conformance.fleet import fleet, pooling_fleet, store_fleet, tenancy

__all__ = ["fleet", "pooling_fleet", "store_fleet", "tenancy"]
