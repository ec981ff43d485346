"""Data paths, one module each, behind the :class:`.base.Path` interface.

``inproc`` (same process), ``shm`` and ``cma`` (same host, one-sided), ``tcp``
(``tcp.py`` requests, ``tcp_streams.py`` its data streams, ``tcp_serve.py`` its
serving half); ``select.py`` picks among the cross-process ones per transfer;
``peer.py`` is what they need from the control connection, ``host.py`` who the peer is.
"""

from .base import Call, Path

__all__ = ["Call", "Path"]
