"""TLS certificates and SuperNode authentication keys for a deployment.

``fedadapt certs --out DIR --host H ...`` makes a private CA and a server
certificate for the SuperLink, valid for the given DNS names and IP addresses
(subjectAltName): ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key``.
``fedadapt node-keys --out DIR --count N`` makes one EC key pair per SuperNode
in OpenSSH format, as Flower 1.41 reads them (``--auth-supernode-private-key``
and ``flwr supernode register <key.pub>``): ``supernode-<i>.key`` and
``supernode-<i>.pub``, ``i`` from 1.

Private keys are written with mode 0600 and never overwritten unless asked
(``force``); keep them out of version control and out of images (mount them).
Certificates are for test and small deployments: use your organisation's CA
where there is one.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_FILES = ("ca.crt", "ca.key", "server.crt", "server.key")


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    """Raise before writing anything when a file exists and force is off."""
    for path in paths:
        if path.exists() and not force:
            raise FileExistsError(f"{path} exists (use --force to replace it)")


def _write(path: Path, data: bytes, private: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600 if private else 0o644)  # also when the file existed


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certificates(
    out_dir: Path, hosts: Sequence[str], days: int = 365, force: bool = False
) -> dict[str, Path]:
    """Write a CA and a SuperLink server certificate signed by it.

    Parameters
    ----------
    out_dir : Path
        Folder for ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key``.
    hosts : sequence of str
        Names and IP addresses clients use to reach the SuperLink (e.g.
        ``localhost``, ``127.0.0.1``, ``superlink``, a public hostname); each
        goes into the certificate's subjectAltName. The first is its CN.
    days : int
        Validity of both certificates.
    force : bool
        Replace existing files.

    Returns
    -------
    dict
        File name → path of the four files.
    """
    if not hosts:
        raise ValueError("certs: give at least one --host (name or IP address)")
    if days < 1:
        raise ValueError(f"certs: invalid days={days}")
    out_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedadapt CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
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
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": (ca_cert.public_bytes(pem), False),
        "ca.key": (_pem_key(ca_key), True),
        "server.crt": (server_cert.public_bytes(pem), False),
        "server.key": (_pem_key(server_key), True),
    }
    _refuse_existing([out_dir / name for name in files], force)
    for name, (data, private) in files.items():
        _write(out_dir / name, data, private)
    return {name: out_dir / name for name in files}


def public_key_path(private_key: Path) -> Path:
    """Return where the public key of a SuperNode key pair lies (``.pub``)."""
    return private_key.with_suffix(".pub")


def make_node_keys(out_dir: Path, count: int, force: bool = False) -> list[Path]:
    """Write ``count`` SuperNode key pairs (EC P-384, OpenSSH format).

    Returns the private key paths ``out_dir/supernode-<i>.key`` (i from 1);
    each public key is next to it as ``supernode-<i>.pub``, the file to pass
    to ``flwr supernode register``.
    """
    if count < 1:
        raise ValueError(f"node-keys: invalid count={count}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"supernode-{i}.key" for i in range(1, count + 1)]
    _refuse_existing([*paths, *(public_key_path(p) for p in paths)], force)
    for path in paths:
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        _write(path, private, private=True)
        _write(public_key_path(path), public + b"\n", private=False)
    return paths
