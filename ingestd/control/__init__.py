"""The control plane: wire protocol, ZeroMQ server, Python client and ``ingestctl``.

- :mod:`~ingestd.control.protocol`: envelopes, error codes, limits (no sockets);
- :mod:`~ingestd.control.commands`: one typed message per command, typed results;
- :mod:`~ingestd.control.handlers`: the ``{request type: handler}`` table;
- :mod:`~ingestd.control.server`: ``ControlServer``, the daemon-side service;
- :mod:`~ingestd.control.sockets`: ipc socket files bound private, never over a live daemon's;
- :mod:`~ingestd.control.client`: ``ControlClient`` and ``EventStream``;
- :mod:`~ingestd.control.curve`: CURVE key files and the ZAP authenticator;
- :mod:`~ingestd.control.cli`: ``ingestctl``;
- :mod:`~ingestd.control.torchfile`: why a file ``ingestctl push-weights`` refused is no state dict.

The wire format is documented in ``docs/protocol.md``.
"""
from ingestd.control.client import ControlClient, CurveKeys, Event, EventStream
from ingestd.control.protocol import ErrorCode

__all__ = ["ControlClient", "CurveKeys", "EventStream", "Event", "ErrorCode"]
