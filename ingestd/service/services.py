"""The daemon's side services (control server, metrics exporter), chosen from the config."""
from __future__ import annotations


def default_services(config) -> list:
    """Services started after the layout exists and stopped before it closes."""
    from ingestd.control.server import ControlServer

    services: list = [ControlServer(config)]
    if config.metrics.enabled:
        from ingestd.metrics import MetricsExporter

        services.append(MetricsExporter(config))
    return services
