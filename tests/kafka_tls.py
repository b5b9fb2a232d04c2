"""Kafka over TLS for the tests: the Tansu broker behind a real stunnel TLS endpoint.

The test broker's own TLS gives no working handshake, so Debian's ``stunnel4`` terminates TLS on
a port of its own and forwards to the broker, which advertises stunnel's port to clients (so
every connection, bootstrap and per-broker, goes through TLS). stunnel also demands a client
certificate signed by the test CA, so the tests exercise mutual TLS with an encrypted client key.
Certificates are made fresh per session with the ``cryptography`` package.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kafka_broker import TansuBroker, _accepts, free_port

START_TIMEOUT_S = 10.0
CLIENT_KEY_PASSWORD = "key-pass-7f3a"  # a test secret that must never show up in any output


def stunnel_binary() -> str | None:
    return shutil.which("stunnel4") or shutil.which("stunnel")


@dataclass(frozen=True)
class Pki:
    ca: Path
    wrong_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path  # encrypted with CLIENT_KEY_PASSWORD


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool,
          san: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def make_pki(directory: Path) -> Pki:
    """A test CA, a server certificate for 127.0.0.1/localhost, a client certificate, and an
    unrelated CA that trusts neither."""
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca = _cert("trainscope test CA", ca_key, "trainscope test CA", ca_key, ca=True)
    other = _cert("some other CA", other_key, "some other CA", other_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert("127.0.0.1", server_key, "trainscope test CA", ca_key, ca=False,
                   san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.DNSName("localhost")])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("trainscope-client", client_key, "trainscope test CA", ca_key, ca=False)
    encrypted = serialization.BestAvailableEncryption(CLIENT_KEY_PASSWORD.encode())
    return Pki(
        ca=_write(directory / "ca.pem", ca.public_bytes(pem)),
        wrong_ca=_write(directory / "wrong-ca.pem", other.public_bytes(pem)),
        server_cert=_write(directory / "server.pem", server.public_bytes(pem)),
        server_key=_write(directory / "server.key", server_key.private_bytes(pem, pkcs8, plain)),
        client_cert=_write(directory / "client.pem", client.public_bytes(pem)),
        client_key=_write(directory / "client.key",
                          client_key.private_bytes(pem, pkcs8, encrypted)),
    )


class TlsBroker:
    """A Tansu broker on a loopback port, reachable only through stunnel's TLS port."""

    def __init__(self, directory: Path) -> None:
        binary = stunnel_binary()
        if binary is None:
            raise RuntimeError("stunnel4 is not installed: apt-get install stunnel4 "
                               "(infra/setup-test-host.sh does)")
        self._binary = binary
        self._directory = directory
        self.pki = make_pki(directory)
        self.tls_port = free_port()
        self.broker = TansuBroker(advertised_port=self.tls_port)
        self._process: subprocess.Popen[bytes] | None = None
        self._log = directory / "stunnel.log"

    def url(self, *, ca: Path | None = None, client_cert: bool = True) -> str:
        query = f"security_protocol=SSL&ssl_cafile={ca or self.pki.ca}"
        if client_cert:
            query += f"&ssl_certfile={self.pki.client_cert}&ssl_keyfile={self.pki.client_key}"
        return f"kafka://127.0.0.1:{self.tls_port}?{query}"

    def start(self) -> TlsBroker:
        self.broker.start()
        config = self._directory / "stunnel.conf"
        config.write_text(
            "foreground = yes\n"
            "pid =\n"
            f"output = {self._log}\n"
            "debug = 4\n"
            "[kafka]\n"
            f"accept = 127.0.0.1:{self.tls_port}\n"
            f"connect = 127.0.0.1:{self.broker.port}\n"
            f"cert = {self.pki.server_cert}\n"
            f"key = {self.pki.server_key}\n"
            f"CAfile = {self.pki.ca}\n"
            "verifyChain = yes\n"  # clients must present a certificate from the test CA
        )
        self._process = subprocess.Popen([self._binary, str(config)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts(self.tls_port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stunnel did not start on 127.0.0.1:{self.tls_port}:\n"
                                   + self.log_text())
            time.sleep(0.01)
        return self

    def log_text(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.broker.cleanup()

    def __enter__(self) -> TlsBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tls_env() -> dict[str, str]:
    """The environment a TLS client of :class:`TlsBroker` needs: the key password."""
    return {"TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD": CLIENT_KEY_PASSWORD}


@contextlib.contextmanager
def environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
