"""TLS for the upstream pool and the simulator: contexts from files, failures in words.

Python's ssl module does all of it (OpenSSL underneath); this module only picks the
settings: certificate and hostname verification always on, TLS 1.2 at least, HTTP/1.1
by ALPN. A context is built when a replica joins (and again on a reload, to take renewed
files) and shared by every connection of its pool: OpenSSL reads the files then, not per
connection.
"""

from __future__ import annotations

import ssl
from pathlib import Path

ALPN = ["http/1.1"]


def client_context(
    ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None
) -> ssl.SSLContext:
    """A client context that verifies the server's chain against ``ca_file`` (the
    system's trust store when None) and its name, presenting ``cert_file``/``key_file``
    when given (mutual TLS). OSError or ssl.SSLError when a file cannot be used."""
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def server_context(
    cert_file: Path, key_file: Path | None, client_ca_file: Path | None = None
) -> ssl.SSLContext:
    """A server context; with ``client_ca_file`` a client must present a certificate
    that chains to it (what a TLS-terminating sidecar in front of vLLM would require)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        context.load_verify_locations(cafile=str(client_ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def tls_failure(exc: ssl.SSLError) -> str:
    """Why a TLS handshake failed, for logs and errors: OpenSSL's verdict on the peer's
    certificate (expired, wrong name, unknown issuer) or the alert it sent. Names no key."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    return str(exc.reason or exc.__class__.__name__).lower().replace("_", " ")
