"""Tenant governance: limits and budgets (docs/limits.md).

Pure: the decisions take the time as an argument and do no I/O, so every rule is tested
against a brute-force checker without sockets; the gateway holds the state and the clock.
"""
