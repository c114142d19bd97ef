"""kiln's own gRPC server: HTTP/2 (RFC 9113) and gRPC on it, on kiln's event loop.
Why not grpc.aio: docs/design/grpc-transport.md.

- ``frames``: frame constants, the incremental reader, encoders
- ``huffman``, ``hpack``: header compression (RFC 7541)
- ``streams``, ``connection``: stream state, the connection protocol, flow control
- ``rpc``: gRPC's wire rules (message framing, timeouts, status blocks, compression)
- ``calls``, ``dispatch``, ``routes``: one call and its context, request headers to calls,
  servicers to routes
- ``server``: listening, TLS, graceful stop

See docs/grpc.md for what is supported.
"""
