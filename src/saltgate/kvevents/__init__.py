"""vLLM's KV-cache events, and the relay that republishes them without what they leak.

Pure (no sockets, no files, no clocks): ``wire`` (vLLM's encodings), ``sanitize`` (what
the relay keeps of an event, and the keyed hashes it puts in), ``sequence`` (sequence
numbers, gaps and the replay window), ``settings`` (the relay's configuration).
I/O over ZMQ: ``publisher`` (vLLM's side, for the simulator), ``relay`` and
``subscriber`` (a relay's consumer). docs/kv-relay.md describes the whole.
"""
