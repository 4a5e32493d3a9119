"""Does the model belong in the route key? Placement measured on the pure router (not a
test; run by hand, results in docs/routing.md, "Models").

    .venv/bin/python tests/routing/bench_model_key.py [--replicas 4] [--trials 200]

Spec v1 keys the route key and the prefix digests by (model, salt, prompt). Replicas of
different models never share a cache, and the router already keeps a request within its
model's replicas, so the key's model only matters where several model names share
replicas. Two cases, each with the model in the key (as shipped) and without (every model
name keyed as one):

- aliases: one model under two names (vLLM's ``--served-model-name a b``): the KV cache is
  shared, so a prompt sent under one name and then the other hits only if both land on
  the same replica. Measured: the share of second sends that land where the first did.
- adapters: k LoRA adapters on the same replicas: vLLM hashes the adapter into its block
  hashes, so the k variants of a prompt never share blocks. Measured: the busiest
  replica's share of the (prompt, adapter) homes, for a few popular system prompts.
"""

from __future__ import annotations

import argparse
import secrets
from collections import Counter

from saltgate.derivations.derive import ROUTE_CHAT, Prompt
from saltgate.routing import Member, ReplicaId, Router, RouterConfig

SALT = "sg1_" + "a" * 43


def fleet(replicas: int, models: list[str]) -> Router:
    members = [Member(ReplicaId(f"http://r{i}")) for i in range(replicas)]
    router = Router(RouterConfig(), secrets.token_bytes(32), members)
    for m in members:
        router.set_models(m.id, models)
    return router


def home(router: Router, seed: str, model: str, keyed_as: str) -> ReplicaId | None:
    """Where a fresh prompt goes (no load, no history) when its key names ``keyed_as``."""
    body = {"messages": [{"role": "system", "content": f"{seed} " + "policy text " * 500}]}
    prompt = Prompt(body, ROUTE_CHAT)
    keys = router.namespace(keyed_as, SALT)
    key = router.request_key(prompt, keys)
    return router.pick(router.plan(key, 0.0, router.prefixes(prompt, keys), model), 0.0)


def aliases(replicas: int, prompts: int) -> dict[str, float]:
    out = {}
    for label, keyed in (("model in key", None), ("model not in key", "one")):
        router = fleet(replicas, ["a", "b"])
        same = 0
        for i in range(prompts):
            first = home(router, f"p{i}", "a", keyed or "a")
            second = home(router, f"p{i}", "b", keyed or "b")
            same += first == second
        out[label] = same / prompts
    return out


def adapters(replicas: int, trials: int, prompts: int = 8, k: int = 4) -> dict[str, float]:
    out = {}
    names = [f"lora{j}" for j in range(k)]
    for label, keyed in (("model in key", None), ("model not in key", "one")):
        worst = 0.0
        for _ in range(trials):
            router = fleet(replicas, names)
            homes = Counter(
                home(router, f"p{i}", name, keyed or name) for i in range(prompts) for name in names
            )
            worst += max(homes.values()) / (prompts * k)
        out[label] = worst / trials
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=2000)
    args = parser.parse_args()
    print(f"{args.replicas} replicas")
    for label, share in aliases(args.replicas, args.prompts).items():
        print(f"aliases, {label}: second name lands where the first did: {share:.1%}")
    for label, share in adapters(args.replicas, args.trials).items():
        print(f"4 adapters x 8 prompts, {label}: busiest replica's share of homes: {share:.1%}")


if __name__ == "__main__":
    main()
