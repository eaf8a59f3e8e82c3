"""The host's fleet operations over MQTT: list devices, deploy a bundle in waves with canaries,
follow a job, roll back. Speaks the protocol in tandoor_contract.protocol."""
