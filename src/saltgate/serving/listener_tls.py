"""The gateway's own listeners over TLS: the admin listener's and the inference listener's
("TLS at the edge", `[gateway] tls_cert_file` and `tls_key_file`).

One loader for both (`listener_context`): the key file passes the secret-file rules
(mode 0600, no symlink), then OpenSSL reads the chain and the key and checks that they
match; any failure is a ConfigError naming the option, as `serve --check` reports it.

The inference listener's certificate is renewed without a restart (`EdgeTls`): the
server is given one context for its lifetime, whose server-name callback hands each new
handshake the context loaded last. A reload (SIGHUP) loads the files into a new context
and swaps it in whole, so no handshake ever sees a certificate without its key; the
connections already open keep the certificate they were opened with.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

from saltgate.config import ConfigError, GatewayConfig, open_secret_file
from saltgate.http.tls import server_context, tls_failure

log = logging.getLogger(__name__)


def listener_context(cert: Path, key: Path, prefix: str = "") -> ssl.SSLContext:
    """A server context from a PEM certificate (chain) and its unencrypted key, the options
    `gateway.<prefix>tls_cert_file` and `<prefix>tls_key_file`; ConfigError naming the
    option at fault when a file cannot be read or the two do not belong together."""
    cert_option, key_option = f"gateway.{prefix}tls_cert_file", f"{prefix}tls_key_file"
    fd = open_secret_file(key, f"gateway.{key_option}")  # mode 0600, no symlink
    try:
        with cert.open("rb"):
            pass
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"{cert_option}: cannot read {cert}: {exc.strerror}") from None
    try:
        return server_context(cert, key)
    except OSError as exc:  # ssl.SSLError included
        reason = tls_failure(exc) if isinstance(exc, ssl.SSLError) else exc.strerror
        raise ConfigError(
            f"{cert_option}, {key_option}: cannot use them ({reason}): "
            "a PEM certificate (chain) and its unencrypted key"
        ) from None
    finally:
        os.close(fd)


def edge_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The inference listener's context from the configured files; None: plain HTTP."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    return listener_context(config.tls_cert_file, config.tls_key_file)


class EdgeTls:
    """The inference listener's TLS: `context` is what the server is given, once; each
    handshake it starts is moved to the context of the certificate loaded last."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self._current = context
        context.sni_callback = self._pick

    def _pick(self, conn: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        # Called for every ClientHello, with a server name or without (a client that
        # dialled an address sends none); before the server's certificate is chosen.
        if self._current is not context:
            conn.context = self._current

    def reload(self, config: GatewayConfig) -> None:
        """SIGHUP: new connections get the configured files as they are now; the current
        certificate stays (logged) when they cannot be used or TLS was switched off."""
        try:
            context = edge_context(config)
        except ConfigError as exc:
            log.error("keeping the current TLS certificate: %s", exc)
            return
        if context is None:
            log.error("keeping TLS: turning it off (gateway.tls_cert_file) takes a restart")
            return
        self._current = context
        log.info("new connections get the TLS certificate %s", config.tls_cert_file)
