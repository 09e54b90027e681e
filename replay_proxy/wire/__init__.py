"""The wire, sans-IO: bytes in, values out. Nothing here touches a socket; one module reads files and the
environment: ``registry``, which schemas there are and where.

For others: ``messages`` (``WireDecoder``, ``Channel``, ``Direction``, ``Side``,
``Kind``: classify a frame and name its fields; ``request_type``: what an input
asks, from its first frame alone), ``schema`` (a release's ``Schema``;
``Schema.read`` and ``read``: one field by name, the rest left undecoded),
``registry`` (``load_schema``, ``schema_for``, ``shipped_releases``,
``load_rust_schema``, ``added_releases``: the package's schemas and those added since),
``handshake`` (parse and rewrite INIT, engine identities), ``encode`` (msgpack
as vLLM writes it), ``capture`` (the recorder's capture format:
``CapturedFrame``, the batches of copies and the relay's entries), ``values``
(msgpack helpers). ``typed`` is the writer's fast path (``store.rows`` alone
uses it); ``extract`` runs inside a vLLM interpreter, started by ``releases``
(pyproject.toml: [tool.importlinter]).
"""
