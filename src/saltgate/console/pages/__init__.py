"""The console's pages, a module each, and its forms (actions.py)."""
