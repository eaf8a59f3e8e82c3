"""Updating the model: A/B slots (a persisted state machine), update jobs over MQTT, and the
health gate that decides commit or rollback."""
