"""Prometheus metrics for ingestd, read from shared state at scrape time.

- :class:`IngestdCollector` (``collector.py``): a prometheus_client collector
  over the stats blocks, the replay header and the weight store;
- :class:`MetricsExporter` (``exporter.py``): the daemon service serving it
  over HTTP on ``[metrics] address:port``.

Every metric is documented in ``docs/metrics.md``.
"""
from ingestd.metrics.collector import RETURN_BUCKETS, BuildInfo, IngestdCollector, ReturnHistogram
from ingestd.metrics.exporter import MetricsExporter, collector_for

__all__ = ["IngestdCollector", "MetricsExporter", "ReturnHistogram", "BuildInfo", "RETURN_BUCKETS",
           "collector_for"]
