"""The daemon's side services (control server, metrics exporter), chosen from the config."""
from __future__ import annotations


def default_services(config) -> list:
    """Services started after the layout exists and stopped before it closes."""
    return []
