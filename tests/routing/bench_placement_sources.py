"""Where placements could come from, priced per request (not a test; run by hand, results
in docs/dev/benchmarks-history.md, "Why N gateways are not yet one").

    .venv/bin/python tests/routing/bench_placement_sources.py [--tokens 7000] [--rounds 20]

The cluster bus shares the placements the routers make: a request costs its gateway the
prefix digests it computes anyway (one SHA-256 pass over the flattened prompt) and an
append to a list; the batch goes out every 20 ms. The alternative is to derive
placements from the replicas' own KV events (vLLM publishes the block hashes each
replica stores, and the relay could hand them to every gateway): the events are ground
truth, evictions included, but to look a request up in them a gateway must compute the
same block hashes vLLM does: tokenize the prompt with the model's tokenizer, then chain
one hash per 16-token block, with the cache salt. This prices both on one prompt of
``--tokens`` tokens (the Mooncake conversation trace averages about 7k): the digests,
the simulator's tokenizer (a stand-in for the model's), and vLLM's block hashing
(`saltgate.sim.hashing`, vLLM's exact sha256_cbor scheme). Best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import timeit

from saltgate.derivations.derive import ROUTE_COMPLETIONS, NamespaceKeys, Prompt
from saltgate.sim.hashing import block_hashes
from saltgate.sim.tokenizer import _tokenize_uncached
from saltgate_bench.trace_schedule import prompt_text

BLOCK_TOKENS = 64  # the replay's tokens per trace block
SALT = "sg1_" + "a" * 43


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    text = prompt_text(list(range(max(1, args.tokens // BLOCK_TOKENS))), BLOCK_TOKENS)
    keys = NamespaceKeys(b"r" * 32, "m", SALT)
    tokens = _tokenize_uncached(text)

    def best(fn: object, number: int = 1) -> float:
        timer = timeit.Timer(fn)  # type: ignore[arg-type]
        return min(timer.repeat(args.rounds, number)) / number * 1e6

    digests_us = best(
        lambda: keys.prefix_digests(Prompt({"prompt": text}, ROUTE_COMPLETIONS).flat(), 1024),
        number=20,
    )
    tokenize_us = best(lambda: _tokenize_uncached(text))
    hash_us = best(lambda: block_hashes(tokens, 16, SALT, "sha256_cbor"))
    print(f"prompt: {len(text)} bytes, {len(tokens)} tokens, {len(tokens) // 16} blocks")
    print(f"gateway prefix digests (flatten + one SHA-256 pass): {digests_us:9.0f} us")
    print(f"tokenize (the simulator's tokenizer):               {tokenize_us:9.0f} us")
    print(f"vLLM block hashes, sha256_cbor, 16-token blocks:    {hash_us:9.0f} us")
    print(f"KV-event lookup costs {(tokenize_us + hash_us) / digests_us:.0f}x the digests")


if __name__ == "__main__":
    main()
