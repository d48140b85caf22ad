"""Certificates for TLS tests, made here: a CA and the certificates it signs, with the
extensions a strict verifier asks for (Python 3.13's default contexts verify with
``VERIFY_X509_STRICT``: a CA's key usage and key identifier, a certificate's authority key
identifier)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _builder(
    subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


class Authority:
    """A self-signed CA for a day, and the certificates it signs."""

    def __init__(self, common_name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        identifier = x509.SubjectKeyIdentifier.from_public_key(self.key.public_key())
        self.certificate = (
            _builder(common_name, _name(common_name), self.key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(identifier, critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def write(self, path: Path) -> Path:
        """This CA's certificate as a PEM file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(
        self, folder: Path, name: str, usage: x509.ObjectIdentifier, dns_name: str | None = None
    ) -> tuple[Path, Path]:
        """A certificate for ``name`` (and for ``dns_name``, a server's) for one extended key
        usage (``ExtendedKeyUsageOID.SERVER_AUTH`` or ``CLIENT_AUTH``), and its key, written
        to ``folder`` as ``name.pem`` and ``name.key``."""
        key = ec.generate_private_key(ec.SECP256R1())
        authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key())
        builder = (
            _builder(name if dns_name is None else dns_name, self.certificate.subject, key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(authority, critical=False)
        )
        if dns_name is not None:
            san = x509.SubjectAlternativeName([x509.DNSName(dns_name)])
            builder = builder.add_extension(san, critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        folder.mkdir(parents=True, exist_ok=True)
        cert_file, key_file = folder / f"{name}.pem", folder / f"{name}.key"
        cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_file, key_file
