"""The ClickHouse store: opening it (chDB directory or server) and asking who owns an embedded
store, shared by the sinks, the what-if store, the dashboard and the commands."""
