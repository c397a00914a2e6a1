"""The EPP's servers: ext-proc for Envoy's routing filter, EDS, their HTTP/2 and TLS.

- ``extproc``: :class:`~.extproc.ExtProcServer`, what the ext-proc streams share (the
  Director, the body budget, completion records), and grpc.aio's servicer.
- ``stream`` and its phases (``stream_base``, ``stream_request``, ``stream_route``,
  ``stream_response``): one request's :class:`~.stream.StreamState`, the hot path;
  ``messages`` reads Envoy's messages and builds the answers, ``usage`` reads the
  response's token usage, ``observer`` the observer filter's copy of a response.
- ``h2``: the default transport, gRPC over HTTP/2 on the event loop itself, framed by
  the native module ``infergate.epp._grpc_h2`` (``native/grpc_h2``).
- ``eds``: Envoy's pool cluster follows the EPP's endpoints over EDS.
- ``tls``: the servers' certificates, and the mutual-TLS bundle the operator issues.

This package imports nothing of its own here, so ``tls`` (the operator's) loads alone.
"""
