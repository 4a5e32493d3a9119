"""Request policy: pure, socket-free checks and rewrites on the request path.

Routes, parsing, inspection and the rewrite live in ``saltgate.policy.request``; the
errors they raise, in OpenAI's shape, in ``saltgate.policy.errors``.
"""

from saltgate.policy.errors import ApiError
from saltgate.policy.headers import forward_request_headers, scrub_response_headers

__all__ = ["ApiError", "forward_request_headers", "scrub_response_headers"]
