"""Tenant governance, the decisions: limits and budgets (docs/limits.md), the fair queue,
the saturation gate and which replica may take a waiting request (docs/fairness.md), the
answers they give (429s, rate-limit headers, the queue's 503 / 529), in a typed
vocabulary (kinds.py).

Pure: the decisions take the time as an argument and do no I/O, so every rule is tested
against a brute-force checker without sockets; the gateway holds the state and the clock
(gateway/governor.py is the request path's one object of it; docs/design.md).
"""
