"""The schema version every record carries (``v``): its own module, so that the modules defining
records import it without importing one another."""

SCHEMA_VERSION = 1
