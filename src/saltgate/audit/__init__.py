"""The isolation audit: timing probes from outside, and deployment checks."""
