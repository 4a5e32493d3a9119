"""Request policy: pure, socket-free checks and rewrites on the request path.

``saltgate.policy.request`` (routes, parsing, inspection, rewrite) is imported from its
module, not re-exported here: ``saltgate.spec.derive`` raises the errors defined in this
package and ``request`` uses ``spec``, so an eager import here would be a cycle.
"""

from saltgate.policy.errors import ApiError
from saltgate.policy.headers import forward_request_headers, scrub_response_headers

__all__ = ["ApiError", "forward_request_headers", "scrub_response_headers"]
