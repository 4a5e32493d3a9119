"""The HTTP edge shared by the gateway and the simulator: a lean server and upstream pool."""

from saltgate.http.client import UpstreamError, UpstreamPool, UpstreamResponse
from saltgate.http.server import Handler, Headers, HttpServer, Request, Response

__all__ = [
    "Handler",
    "Headers",
    "HttpServer",
    "Request",
    "Response",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]
