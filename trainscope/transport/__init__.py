"""The bus: its protocol, the in-memory and Kafka implementations (TLS/SASL included), the
``open_bus`` factory and the Kafka producer's outbox."""
