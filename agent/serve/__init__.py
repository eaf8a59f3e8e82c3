"""Serving a camera: the service loop, frame sources, pre- and post-processing (decoders), the
MQTT link, systemd's sd_notify and the agent's configuration."""
