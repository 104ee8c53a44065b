"""A throwaway private certificate authority for tests: a CA and one server certificate signed by
it, written as PEM files. Used by tests and ``S3Server(tls=True)``; never by library code.

Contract: ``make_tls_files(directory)`` writes ``ca.pem`` (the CA certificate: what a client
trusts), ``server.pem`` (the server certificate, for ``127.0.0.1`` and ``localhost`` unless told
otherwise) and ``server-key.pem`` (its private key, mode 0600), valid from five minutes ago for one
day. Nothing on the machine trusts the CA unless told to (``AWS_CA_BUNDLE``, a profile's
``ca_bundle``, ``StorageOptions(verify_tls=path)``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TLSFiles", "make_tls_files"]


@dataclass(frozen=True, kw_only=True)
class TLSFiles:
    """Paths of the PEM files written by ``make_tls_files``."""

    ca_file: str
    cert_file: str
    key_file: str


def make_tls_files(
    directory: str | os.PathLike,
    *,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    ca_name: str = "cloudckpt test CA",
) -> TLSFiles:
    """Create a CA and a server certificate for ``hosts`` (IP addresses or DNS names) in
    ``directory`` (created if needed); return their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(issuer)
        .issuer_name(issuer)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    files = TLSFiles(
        ca_file=str(out / "ca.pem"),
        cert_file=str(out / "server.pem"),
        key_file=str(out / "server-key.pem"),
    )
    Path(files.ca_file).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    Path(files.cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(files.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return files
