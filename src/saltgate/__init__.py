"""saltgate: a secure prompt-caching gateway for multi-tenant LLM inference."""

__version__ = "0.1.0"
