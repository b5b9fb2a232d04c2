"""How every Kafka client of trainscope authenticates: TLS and SASL settings, resolved once.

One frozen :class:`KafkaSecurity` per bus, from the ``kafka://`` URL's query (which wins) and
the ``TRAINSCOPE_KAFKA_*`` environment variables (see :mod:`trainscope.config.env`). Secrets — the
SASL password and the password of the client key — come only from the environment or from a
file named there or in the URL; a URL that carries one is refused, because URLs end up in
command lines, logs and error messages. ``repr`` and :meth:`KafkaSecurity.describe` never show
a secret.

    kafka://broker:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-256
        &sasl_username=trainer&ssl_cafile=/etc/kafka/ca.pem
    TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE=/run/secrets/kafka-password
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from trainscope.config import env

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

# URL query key → environment variable. Secrets are absent on purpose: they have no URL key.
_SETTINGS = {
    "security_protocol": env.TRAINSCOPE_KAFKA_SECURITY_PROTOCOL,
    "ssl_cafile": env.TRAINSCOPE_KAFKA_SSL_CAFILE,
    "ssl_certfile": env.TRAINSCOPE_KAFKA_SSL_CERTFILE,
    "ssl_keyfile": env.TRAINSCOPE_KAFKA_SSL_KEYFILE,
    "ssl_key_password_file": env.TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD_FILE,
    "ssl_check_hostname": env.TRAINSCOPE_KAFKA_SSL_CHECK_HOSTNAME,
    "sasl_mechanism": env.TRAINSCOPE_KAFKA_SASL_MECHANISM,
    "sasl_username": env.TRAINSCOPE_KAFKA_SASL_USERNAME,
    "sasl_password_file": env.TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE,
}
_SECRET_KEYS = (
    "password", "sasl_password", "ssl_password", "ssl_key_password", "sasl_plain_password"
)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class KafkaSettingsError(ValueError):
    """The Kafka connection settings are incomplete or contradict each other; says which."""


@dataclass(frozen=True)
class KafkaSecurity:
    security_protocol: str = "PLAINTEXT"
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: str | None = field(default=None, repr=False)
    ssl_check_hostname: bool = True
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.security_protocol not in PROTOCOLS:
            raise KafkaSettingsError(
                f"security_protocol must be one of {', '.join(PROTOCOLS)}, "
                f"got {self.security_protocol!r}"
            )
        if self.uses_sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise KafkaSettingsError(
                    f"sasl_mechanism must be one of {', '.join(SASL_MECHANISMS)}, "
                    f"got {self.sasl_mechanism!r}"
                )
            if not self.sasl_username:
                raise KafkaSettingsError(
                    f"SASL needs a user name: sasl_username in the URL or "
                    f"{env.TRAINSCOPE_KAFKA_SASL_USERNAME}"
                )
            if not self.sasl_password:
                raise KafkaSettingsError(
                    f"SASL needs a password: {env.TRAINSCOPE_KAFKA_SASL_PASSWORD} or "
                    f"{env.TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE}"
                )
        elif self.sasl_mechanism or self.sasl_username:
            raise KafkaSettingsError(
                f"SASL settings given but security_protocol is {self.security_protocol}; "
                f"use SASL_SSL (or SASL_PLAINTEXT)"
            )
        if not self.uses_tls and (self.ssl_cafile or self.ssl_certfile or self.ssl_keyfile):
            raise KafkaSettingsError(
                f"TLS files given but security_protocol is {self.security_protocol}; "
                f"use SSL or SASL_SSL"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise KafkaSettingsError("ssl_keyfile needs ssl_certfile (the client certificate)")

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    def __repr__(self) -> str:
        return f"KafkaSecurity({self.describe()})"

    __str__ = __repr__

    def describe(self) -> str:
        """One line for logs and errors; never contains a secret."""
        parts = [self.security_protocol]
        if self.uses_tls:
            parts.append(f"CA file {self.ssl_cafile}" if self.ssl_cafile else "system CAs")
            if self.ssl_certfile:
                parts.append(f"client certificate {self.ssl_certfile}")
            if not self.ssl_check_hostname:
                parts.append("no hostname check")
        if self.uses_sasl:
            parts.append(f"SASL {self.sasl_mechanism} as {self.sasl_username!r}")
        return ", ".join(parts)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context (reads the CA, certificate and key files); ``None`` without TLS."""
        if not self.uses_tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.ssl_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise KafkaSettingsError(f"cannot load the Kafka CA file {self.ssl_cafile}: "
                                     f"{_reason(exc)}") from None
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile:
            try:
                context.load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile, password=self.ssl_key_password or None
                )
            except (OSError, ssl.SSLError) as exc:
                what = self.ssl_certfile + (f" / {self.ssl_keyfile}" if self.ssl_keyfile else "")
                hint = "" if self.ssl_key_password else " (an encrypted key needs its password)"
                raise KafkaSettingsError(
                    f"cannot load the Kafka client certificate {what}: {_reason(exc)}{hint}"
                ) from None
        return context

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for every aiokafka client (producer, consumer, admin)."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_tls:
            kwargs["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        return kwargs

    @classmethod
    def resolve(
        cls, query: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
    ) -> KafkaSecurity:
        """From a URL's query parameters (first) and the environment (second)."""
        query = dict(query or {})
        environ = os.environ if environ is None else environ
        secret = [k for k in query if k.lower() in _SECRET_KEYS]
        if secret:
            raise KafkaSettingsError(
                f"the Kafka URL must not carry a secret ({', '.join(secret)}): set "
                f"{env.TRAINSCOPE_KAFKA_SASL_PASSWORD} / {env.TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD} "
                f"or their _FILE variants"
            )
        unknown = sorted(set(query) - set(_SETTINGS))
        if unknown:
            raise KafkaSettingsError(
                f"unknown Kafka URL setting(s) {', '.join(unknown)}; known: {', '.join(_SETTINGS)}"
            )
        raw = {key: query.get(key) or environ.get(var) or None for key, var in _SETTINGS.items()}
        protocol = (raw["security_protocol"] or "").upper()
        if not protocol:  # infer the obvious: TLS files mean TLS, a SASL mechanism means SASL
            tls = bool(raw["ssl_cafile"] or raw["ssl_certfile"])
            sasl = bool(raw["sasl_mechanism"])
            protocol = {(False, False): "PLAINTEXT", (True, False): "SSL"}.get(
                (tls, sasl), "SASL_SSL"
            )
        return cls(
            security_protocol=protocol,
            ssl_cafile=raw["ssl_cafile"],
            ssl_certfile=raw["ssl_certfile"],
            ssl_keyfile=raw["ssl_keyfile"],
            ssl_key_password=_secret(
                environ, env.TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD, raw["ssl_key_password_file"]
            ),
            ssl_check_hostname=_flag(raw["ssl_check_hostname"], "ssl_check_hostname"),
            sasl_mechanism=(raw["sasl_mechanism"] or "").upper() or None,
            sasl_username=raw["sasl_username"],
            sasl_password=_secret(
                environ, env.TRAINSCOPE_KAFKA_SASL_PASSWORD, raw["sasl_password_file"]
            ),
        )


def parse_kafka_url(
    url: str, environ: Mapping[str, str] | None = None
) -> tuple[str, KafkaSecurity]:
    """``kafka://HOST:PORT[,HOST:PORT...][?settings]`` → (bootstrap servers, security)."""
    if not url.startswith("kafka://"):
        raise KafkaSettingsError(f"not a Kafka URL: expected kafka://HOST:PORT, got {url[:40]!r}")
    rest = url.removeprefix("kafka://")
    servers, _, query = rest.partition("?")
    servers = servers.strip("/")
    if "@" in servers:
        # Never echo what precedes the '@': it is a user name and maybe a password.
        raise KafkaSettingsError(
            f"the Kafka URL must not carry credentials before '@'; set "
            f"{env.TRAINSCOPE_KAFKA_SASL_USERNAME} and {env.TRAINSCOPE_KAFKA_SASL_PASSWORD} "
            f"(or sasl_username in the URL query) instead"
        )
    if not servers:
        raise KafkaSettingsError("the Kafka URL names no broker (expected kafka://HOST:PORT)")
    try:
        pairs = parse_qsl(urlsplit("x://h?" + query).query, keep_blank_values=True,
                          strict_parsing=bool(query))
    except ValueError:
        raise KafkaSettingsError("cannot parse the Kafka URL's settings after '?'") from None
    return servers, KafkaSecurity.resolve(dict(pairs), environ)


def _secret(environ: Mapping[str, str], var: str, path: str | None) -> str | None:
    value = environ.get(var)
    if value:
        return value
    path = path or environ.get(var + "_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().rstrip("\r\n") or None
    except OSError as exc:
        raise KafkaSettingsError(f"cannot read the secret file {path}: {exc.strerror}") from None


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise KafkaSettingsError(f"{name} must be true or false, got {value!r}")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
