"""Reading a server's raw output as h11's client state machine would, one response a time.

A response cut short, merged into another or carrying a body it must not have (after HEAD,
say) breaks the parse, so tests of the HTTP edge read what it wrote with this.
"""

from __future__ import annotations

from typing import NamedTuple

import h11


class Answer(NamedTuple):
    status: int
    body: bytes
    informational: list[int]  # 1xx statuses that came before it (100 Continue)


def h11_client(out: bytes) -> h11.Connection:
    """A client connection that has received ``out`` and then the server's close."""
    client = h11.Connection(h11.CLIENT)
    client.receive_data(out)
    client.receive_data(b"")
    return client


def next_answer(client: h11.Connection) -> Answer:
    """The response to the request just sent on ``client`` (its events must be sent)."""
    status, body, informational = 0, b"", []
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA, "the response is incomplete"
        if isinstance(event, h11.InformationalResponse):
            informational.append(event.status_code)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
    return Answer(status, body, informational)


def responses(out: bytes, methods: list[str]) -> list[Answer]:
    """(status, body, informational statuses) per request, read as h11's client would;
    the server must have closed after the last, with nothing after it."""
    client = h11_client(out)
    got = []
    for method in methods:
        client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        got.append(next_answer(client))
        if client.their_state is h11.MUST_CLOSE:
            break
        client.start_next_cycle()
    assert client.trailing_data == (b"", True), client.trailing_data
    return got
