"""Kafka TLS/SASL settings: resolution from the URL and the environment, validation, redaction.

No Kafka broker with SASL users can run here, so SASL is tested up to the aiokafka client: the
settings it receives (a real ``AIOKafkaProducer`` is constructed, not started), and the error
when a broker refuses the SASL handshake. Nothing here pretends to authenticate; TLS against a
real endpoint is in ``test_kafka_tls.py``.
"""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from trainscope.transport.bus import BusError, open_bus
from trainscope.transport.kafka import KafkaBus
from trainscope.transport.security import (
    KafkaSecurity,
    KafkaSettingsError,
    parse_kafka_url,
)

SECRET = "s3cr3t-Pa55"


def test_scram_settings_from_url_and_password_from_env_reach_aiokafka() -> None:
    url = ("kafka://b1:9093,b2:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512"
           "&sasl_username=trainer")
    servers, security = parse_kafka_url(url, {"TRAINSCOPE_KAFKA_SASL_PASSWORD": SECRET})
    assert servers == "b1:9093,b2:9093"
    kwargs = security.client_kwargs()
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["ssl_context"] is not None  # system CAs
    assert (kwargs["sasl_mechanism"], kwargs["sasl_plain_username"],
            kwargs["sasl_plain_password"]) == ("SCRAM-SHA-512", "trainer", SECRET)

    async def construct() -> list[dict[str, object]]:
        producer = AIOKafkaProducer(bootstrap_servers=servers, **kwargs)
        consumer = AIOKafkaConsumer(bootstrap_servers=servers, **kwargs)
        clients = [producer.client, consumer._client]  # aiokafka's connection managers
        seen = [{k: v for k, v in vars(c).items() if "sasl" in k} for c in clients]
        for client in clients:
            await client.close()
        return seen

    for seen in asyncio.run(construct()):
        assert seen["_sasl_mechanism"] == "SCRAM-SHA-512"
        assert seen["_sasl_plain_username"] == "trainer"
        assert seen["_sasl_plain_password"] == SECRET


def test_environment_alone_configures_plain_sasl_with_a_password_file(tmp_path) -> None:
    secret_file = tmp_path / "password"
    secret_file.write_text(SECRET + "\n")
    security = KafkaSecurity.resolve({}, {
        "TRAINSCOPE_KAFKA_SASL_MECHANISM": "plain",
        "TRAINSCOPE_KAFKA_SASL_USERNAME": "trainer",
        "TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE": str(secret_file),
    })
    assert security.security_protocol == "SASL_SSL"  # inferred: never send a password in clear
    assert security.sasl_mechanism == "PLAIN" and security.sasl_password == SECRET


def test_the_url_wins_over_the_environment() -> None:
    security = KafkaSecurity.resolve(
        {"sasl_mechanism": "SCRAM-SHA-256"},
        {"TRAINSCOPE_KAFKA_SASL_MECHANISM": "PLAIN", "TRAINSCOPE_KAFKA_SASL_USERNAME": "u",
         "TRAINSCOPE_KAFKA_SASL_PASSWORD": SECRET},
    )
    assert security.sasl_mechanism == "SCRAM-SHA-256"


def test_repr_and_description_never_show_secrets() -> None:
    security = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                             sasl_username="trainer", sasl_password=SECRET,
                             ssl_key_password=SECRET)
    for text in (repr(security), str(security), security.describe(), f"{security!r}"):
        assert SECRET not in text and "trainer" in text


@pytest.mark.parametrize(
    "url",
    [
        f"kafka://h:9093?security_protocol=SASL_SSL&sasl_password={SECRET}",
        f"kafka://h:9093?ssl_key_password={SECRET}",
        f"kafka://h:9093?password={SECRET}",
        f"kafka://trainer:{SECRET}@h:9093",
    ],
)
def test_a_secret_in_the_url_is_refused_without_echoing_it(url: str) -> None:
    with pytest.raises(KafkaSettingsError) as refused:
        open_bus(url)
    text = str(refused.value)
    assert SECRET not in text and "TRAINSCOPE_KAFKA_SASL_PASSWORD" in text


@pytest.mark.parametrize(
    ("query", "environ", "needle"),
    [
        ({"security_protocol": "SASL_SSL", "sasl_username": "u"}, {}, "sasl_mechanism must be"),
        ({"sasl_mechanism": "GSSAPI", "sasl_username": "u"}, {}, "sasl_mechanism must be"),
        ({"sasl_mechanism": "PLAIN"}, {"TRAINSCOPE_KAFKA_SASL_PASSWORD": SECRET}, "user name"),
        ({"sasl_mechanism": "PLAIN", "sasl_username": "u"}, {}, "SASL needs a password"),
        ({"security_protocol": "PLAINTEXT", "ssl_cafile": "/x"}, {}, "TLS files given"),
        ({"security_protocol": "tls"}, {}, "security_protocol must be"),
        ({"ssl_check_hostname": "maybe", "ssl_cafile": "/x"}, {}, "true or false"),
        ({"sasl_pasword_file": "/x"}, {}, "unknown Kafka URL setting(s) sasl_pasword_file"),
    ],
)
def test_incomplete_or_contradicting_settings_name_the_problem(query, environ, needle) -> None:
    with pytest.raises(KafkaSettingsError, match=re.escape(needle)):
        KafkaSecurity.resolve(query, environ)


def test_tls_files_are_checked_when_the_bus_is_made(tmp_path) -> None:
    with pytest.raises(KafkaSettingsError, match=r"cannot load the Kafka CA file .*missing\.pem"):
        open_bus(f"kafka://127.0.0.1:9093?ssl_cafile={tmp_path / 'missing.pem'}")


def test_encrypted_client_key_without_its_password_is_a_clear_error(tls_kafka_broker,
                                                                    monkeypatch) -> None:
    monkeypatch.delenv("TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD", raising=False)
    with pytest.raises(KafkaSettingsError, match="an encrypted key needs its password"):
        open_bus(tls_kafka_broker.url())


@pytest.mark.kafka
def test_a_refused_sasl_login_is_one_line_without_the_password(kafka_broker, caplog) -> None:
    """The test broker has no SASL users: it refuses the SASL handshake, which is the refused
    login path. A successful SASL login is not tested here; no broker for it is available."""
    caplog.set_level(logging.DEBUG, logger="trainscope")
    bus = KafkaBus(kafka_broker.bootstrap_servers, security=KafkaSecurity(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
        sasl_username="trainer", sasl_password=SECRET))
    try:
        with pytest.raises(BusError) as refused:
            bus.connect(timeout_s=20)
    finally:
        bus.close()
    text = str(refused.value)
    assert text == (f"cannot reach Kafka at {kafka_broker.bootstrap_servers}: the broker refused "
                    "the SASL login (SASL_PLAINTEXT, SASL SCRAM-SHA-256 as 'trainer'): check "
                    "the user name, password and mechanism")
    assert SECRET not in caplog.text
