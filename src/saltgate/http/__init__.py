"""The HTTP edge shared by the gateway and the simulator: a lean server and upstream pool."""

from saltgate.http.client import UpstreamError, UpstreamPool, UpstreamResponse
from saltgate.http.server import BodyStream, Client, Handler, Headers, HttpServer, Request, Response

__all__ = [
    "BodyStream",
    "Client",
    "Handler",
    "Headers",
    "HttpServer",
    "Request",
    "Response",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]
