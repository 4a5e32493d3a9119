"""The admin plane on the admin listener: admin tokens, scopes, the admin API (issue 24).

A docstring only, so `saltgate.admin.scopes` stays pure: importing the package loads no
store and no socket.
"""
