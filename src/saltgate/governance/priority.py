"""Priority bands of API keys (issue 23): pure data, shared by the store, the CLI and the
fair queue.

When the replicas are saturated, every waiting request of a higher band goes before any of
a lower one, and tenants are served fairly within a band. A key's band is fixed when it is
created (saltgate keys create --priority batch); keys are interactive unless created as
batch, so an operator marks the traffic that can wait, not the traffic that cannot.
"""

from __future__ import annotations

PRIORITIES = ("interactive", "batch")  # highest first
DEFAULT_PRIORITY = PRIORITIES[0]
