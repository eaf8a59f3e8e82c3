"""The fleet console (`tandoor fleet console`): an MQTT consumer that keeps every device's status,
telemetry, results, snapshots and update/key acks in a database (SQLite or PostgreSQL), and a small
web server with the fleet, device and deployment pages (docs/fleet.md, "The console")."""
