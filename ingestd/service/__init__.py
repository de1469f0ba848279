"""The daemon: config, supervisor, signals, sd_notify (see ``ingestd.service.config``)."""
