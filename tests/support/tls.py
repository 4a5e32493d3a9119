"""A private certificate authority for TLS tests, minted with `cryptography`.

Two CAs (one for servers, one for clients), and from them the certificates the tests need:
a good server certificate for 127.0.0.1 and localhost, an expired one, one for another
host name, one from an unknown CA, and a client certificate for mutual TLS. Written as
PEM files, private keys with mode 0600 (the gateway refuses any other).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Pair:
    """A certificate and its key on disk."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the servers' CA bundle, what tls_ca_file names
    server: Pair  # 127.0.0.1 and localhost, valid now
    expired: Pair  # same names, expired yesterday
    wrong_host: Pair  # valid, for wrong.example only
    unknown_ca: Pair  # valid for 127.0.0.1, from a CA nobody trusts
    client_ca: Path  # the CA a mutual-TLS server requires client certificates from
    client: Pair  # a client certificate from client_ca


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca(common: str) -> tuple[x509.Certificate, Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, Key],
    common: str,
    names: list[x509.GeneralName],
    *,
    client: bool = False,
    expired: bool = False,
) -> tuple[x509.Certificate, Key]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = (
        (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
        if expired
        else (now - datetime.timedelta(days=1), now + datetime.timedelta(days=30))
    )
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_pair(directory: Path, name: str, pair: tuple[x509.Certificate, Key]) -> Pair:
    cert, key = pair
    key_path = directory / f"{name}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return Pair(_write_cert(directory / f"{name}.pem", cert), key_path)


LOCAL_NAMES: list[x509.GeneralName] = [
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    x509.DNSName("localhost"),
]


def make_pki(directory: Path) -> Pki:
    """Every certificate of `Pki`, written under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    server_ca = _ca("saltgate test server CA")
    client_ca = _ca("saltgate test client CA")
    stranger = _ca("saltgate test unknown CA")
    return Pki(
        ca=_write_cert(directory / "ca.pem", server_ca[0]),
        server=_write_pair(directory, "server", _leaf(server_ca, "replica", LOCAL_NAMES)),
        expired=_write_pair(
            directory, "expired", _leaf(server_ca, "replica", LOCAL_NAMES, expired=True)
        ),
        wrong_host=_write_pair(
            directory,
            "wrong-host",
            _leaf(server_ca, "wrong.example", [x509.DNSName("wrong.example")]),
        ),
        unknown_ca=_write_pair(directory, "unknown-ca", _leaf(stranger, "replica", LOCAL_NAMES)),
        client_ca=_write_cert(directory / "client-ca.pem", client_ca[0]),
        client=_write_pair(directory, "client", _leaf(client_ca, "gateway", [], client=True)),
    )
