"""Routing by model through the real gateway, with simulated replicas serving different
models: a request reaches only replicas of its model; an unknown model (or one outside the
tenant's allowed list) is 404 in the API's own shape and reaches no replica; a model whose
replicas are all down is 503; a replica restarted with another model is followed; pinned
models win over the probe. (Both store backends: tests/gateway/test_store_fleet.py.)"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import httpx
import orjson
import pytest
from tests.gateway.stack import Stack, long_prompt, run, stack
from tests.routing.test_routing_gateway import available, kill
from tests.support.waiting import eventually

from saltgate.routing import RouterConfig
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.tenants import TenantStore

FAST_PROBES = RouterConfig(probe_interval_s=0.1, probe_timeout_s=1.0, probe_failures=2)
MESSAGES = "/v1/messages"


def body(route: str, model: str, text: str) -> dict[str, Any]:
    if route == "/v1/completions":
        return {"model": model, "prompt": text, "max_tokens": 2}
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def not_found(model: str, route: str) -> dict[str, Any]:
    """The 404 the gateway must answer: OpenAI's `model_not_found`, Anthropic's shape on
    /v1/messages."""
    message = f"The model `{model}` does not exist or you do not have access to it."
    if route == MESSAGES:
        return {"type": "error", "error": {"type": "not_found_error", "message": message}}
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def models_seen(s: Stack) -> list[set[str]]:
    """Per replica, the models named by the requests it received."""
    return [
        {orjson.loads(r.body)["model"] for r in tap.seen if r.method == b"POST"} for tap in s.taps
    ]


async def listed(client: httpx.AsyncClient) -> list[str]:
    resp = await client.get("/v1/models")
    assert resp.status_code == 200
    return sorted(m["id"] for m in resp.json()["data"])


async def post(client: httpx.AsyncClient, route: str, model: str, text: str) -> httpx.Response:
    return await client.post(route, json=body(route, model, text))


def probes(s: Stack) -> int:
    """The /v1/models probes the first replica has answered."""
    return sum(r.path == b"/v1/models" for r in s.taps[0].seen)


ROUTES = ("/v1/chat/completions", "/v1/completions", MESSAGES)


def test_each_request_goes_only_to_replicas_of_its_model(tmp_path: Any) -> None:
    async def main() -> None:
        models = ("alpha", "beta", "alpha")
        async with stack(tmp_path, replicas=3, models=models) as s, s.client("alice") as c:
            assert await listed(c) == ["alpha", "beta"]
            for i in range(8):
                for route in ROUTES:
                    for model in ("alpha", "beta"):
                        # long prompts get a route key (rendezvous), short ones none
                        text = long_prompt(f"{model}{i}", 800) if i % 2 else f"hi {i}"
                        resp = await post(c, route, model, text)
                        assert resp.status_code == 200, resp.text
            assert models_seen(s) == [{"alpha"}, {"beta"}, {"alpha"}]

    run(main)


def test_an_unknown_model_is_404_in_each_apis_shape_and_reaches_no_replica(
    tmp_path: Any,
) -> None:
    async def main() -> None:
        async with stack(tmp_path, models=("alpha", "beta")) as s, s.client("alice") as c:
            for route in ROUTES:
                resp = await post(c, route, "gpt-nope", "hello")
                assert (resp.status_code, resp.json()) == (404, not_found("gpt-nope", route))
            assert s.forwarded() == []

    run(main)


def test_a_model_whose_replicas_are_all_down_is_503_and_no_other_replica_gets_it(
    tmp_path: Any,
) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, models=("alpha", "beta"), router=FAST_PROBES) as s,
            s.client("alice") as c,
        ):
            assert (await post(c, "/v1/completions", "beta", "before")).status_code == 200
            await kill(s.taps[1])
            await eventually(lambda: not available(s, 1), what="beta's replica taken out")
            assert await listed(c) == ["alpha"]  # what healthy replicas serve
            for i, route in enumerate(ROUTES):
                resp = await post(c, route, "beta", long_prompt(f"down{i}"))
                assert resp.status_code == 503, resp.text
                assert resp.json()["error"]["code"] == "no_replica"
            assert models_seen(s)[0] == set()  # alpha's replica never saw a beta request
            resp = await post(c, "/v1/completions", "gpt-nope", "x")
            assert resp.status_code == 404  # unknown stays unknown, not 503

    run(main)


def test_a_replica_restarted_with_another_model_is_followed(tmp_path: Any) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, models=("alpha", "beta"), router=FAST_PROBES) as s,
            s.client("alice") as c,
        ):
            old = s.sims[1]
            await old.close()
            s.sims[1] = await start_sim(SimConfig(port=old.port, model="gamma"))

            async def gamma_replaces_beta() -> bool:
                return await listed(c) == ["alpha", "gamma"]

            await eventually(gamma_replaces_beta, what="the gateway follows the new model")
            for i in range(8):
                text = long_prompt(f"gamma{i}", 800) if i % 2 else f"hi {i}"
                resp = await post(c, "/v1/completions", "gamma", text)
                assert resp.status_code == 200, resp.text
            assert "gamma" not in models_seen(s)[0]
            resp = await post(c, "/v1/completions", "beta", "gone")
            assert (resp.status_code, resp.json()) == (404, not_found("beta", "/v1/completions"))

    run(main)


def test_pinned_models_win_over_the_probe_which_is_logged(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, models=("alpha", "beta"), router=FAST_PROBES) as s,
            s.client("alice") as c,
        ):
            config = s.gateway.gateway.config
            first, second = config.replicas
            pinned = dataclasses.replace(first, models=("alpha", "alpha-alias"))
            s.gateway.reload(dataclasses.replace(config, replicas=(pinned, second)))
            assert await listed(c) == ["alpha", "alpha-alias", "beta"]
            ready = s.gateway.gateway.readiness("alpha-alias")  # /ready?model= knows pins
            assert ready[0] and ready[1]["models"]["alpha-alias"] is True
            await eventually(
                lambda: "is pinned to ['alpha', 'alpha-alias']" in caplog.text,
                what="the mismatch logged",
            )
            resp = await post(c, "/v1/completions", "alpha-alias", "pinned")
            assert resp.status_code == 404  # the replica's own answer: it was sent there
            assert models_seen(s) == [{"alpha-alias"}, set()]
            warned = caplog.text.count("is pinned to")
            probed = probes(s)
            await eventually(lambda: probes(s) >= probed + 3, what="three more probes")
            assert caplog.text.count("is pinned to") == warned  # once, not at every probe

    with caplog.at_level(logging.WARNING, "saltgate.gateway.replicas"):
        run(main)


def test_a_tenants_allowed_models_hide_the_others_as_if_they_did_not_exist(
    tmp_path: Any,
) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, models=("alpha", "beta")) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            with TenantStore.from_state_dir(s.state_dir) as store:
                store.set_models("alice", ["alpha"])

            async def alice_sees_alpha_only() -> bool:
                return await listed(alice) == ["alpha"]

            await eventually(alice_sees_alpha_only, what="the allow-list reaches the gateway")
            for route in ROUTES:
                resp = await post(alice, route, "beta", "not for alice")
                assert (resp.status_code, resp.json()) == (404, not_found("beta", route))
                assert (await post(alice, route, "alpha", "fine")).status_code == 200
                assert (await post(bob, route, "beta", "fine for bob")).status_code == 200
            assert await listed(bob) == ["alpha", "beta"]
            beta_bodies = [r.body for r in s.taps[1].seen if r.method == b"POST"]
            assert len(beta_bodies) == len(ROUTES)  # bob's only
            assert all(s.salt("bob").encode() in b for b in beta_bodies)
            # A request that names no model would get the replica's default: refused.
            resp = await alice.post("/tokenize", json={"prompt": "x"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"

            with TenantStore.from_state_dir(s.state_dir) as store:
                store.set_models("alice", None)

            async def alice_sees_all() -> bool:
                return await listed(alice) == ["alpha", "beta"]

            await eventually(alice_sees_all, what="--all reaches the gateway")
            assert (await post(alice, "/v1/completions", "beta", "now")).status_code == 200

    run(main)
