"""Sinks: the ClickHouse writer and alert notifiers."""
