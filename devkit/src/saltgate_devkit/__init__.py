"""What saltgate's tests (tests/support) and benchmarks (benchmarks/) both start and stop:
throwaway PostgreSQL, Redis and HAProxy servers (services.py) and children in their own
process groups (procs.py). Not part of the product: the saltgate wheel leaves it out."""
