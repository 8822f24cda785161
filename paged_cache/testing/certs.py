"""Certificates for TLS tests: a throwaway CA, a server certificate for 127.0.0.1 / localhost and a
client certificate, written as PEM files (made with the ``cryptography`` package, a dev extra)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VALID_DAYS = 2


@dataclass(frozen=True)
class TLSCerts:
    """PEM files of one throwaway CA and the certificates it signed (each with its key)."""

    ca: Path
    ca_key: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of them (a client trusting it must refuse the server)
    elsewhere: Path  # a server certificate of this CA for another host name (example.invalid)
    elsewhere_key: Path


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, key: Any, cert: Any) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    path.with_suffix(".key").chmod(0o600)
    return path.with_suffix(".crt"), path.with_suffix(".key")


def _certificate(subject: str, key: Any, issuer: tuple[str, Any] | None, *, ca: bool = False,
                 hosts: tuple[str, ...] = (), client: bool = False) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name = name if issuer is None else x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, issuer[0])])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h)
                 for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    # Python 3.13's default context verifies strictly (VERIFY_X509_STRICT): key identifiers and a
    # key usage that says what each key may sign are required, as public CAs issue them.
    signer = key if issuer is None else issuer[1]
    builder = (builder
               .add_extension(x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca,
                                            crl_sign=ca, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   signer.public_key()), critical=False))
    return builder.sign(signer, hashes.SHA256())


def make_test_certs(directory: Path) -> TLSCerts:
    """A CA, a server certificate (127.0.0.1, localhost), a client certificate and a server
    certificate for another host that it signed, and an unrelated CA, as PEM files in
    ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, other_key = _key(), _key()
    ca_cert = _certificate("paged-cache test CA", ca_key, None, ca=True)
    ca, ca_key_path = _write(directory / "ca", ca_key, ca_cert)
    other_ca, _ = _write(directory / "other-ca", other_key,
                         _certificate("another CA", other_key, None, ca=True))
    issuer = ("paged-cache test CA", ca_key)
    server_key, client_key = _key(), _key()
    server, server_key_path = _write(directory / "server", server_key, _certificate(
        "127.0.0.1", server_key, issuer, hosts=("127.0.0.1", "localhost")))
    client, client_key_path = _write(directory / "client", client_key, _certificate(
        "paged-cache client", client_key, issuer, client=True))
    elsewhere_key = _key()
    elsewhere, elsewhere_key_path = _write(directory / "elsewhere", elsewhere_key, _certificate(
        "example.invalid", elsewhere_key, issuer, hosts=("example.invalid",)))
    return TLSCerts(ca, ca_key_path, server, server_key_path, client, client_key_path, other_ca,
                    elsewhere, elsewhere_key_path)
