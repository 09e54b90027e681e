"""The wire, sans-IO: bytes in, values out. Nothing here touches a socket or a file.

For others: ``messages`` (``WireDecoder``, ``Channel``, ``Direction``, ``Side``,
``Kind``: classify a frame and name its fields; ``request_type``: what an input
asks, from its first frame alone), ``schema`` (a release's ``Schema``,
``load_schema``, ``schema_for``, ``shipped_releases``; ``Schema.read`` and
``read``: one field by name, the rest left undecoded),
``handshake`` (parse and rewrite INIT, engine identities), ``encode`` (msgpack
as vLLM writes it), ``capture`` (the recorder's capture format:
``CapturedFrame``, the batches of copies and the relay's entries), ``values``
(msgpack helpers). ``typed`` is the writer's fast path (``store.rows`` alone
uses it); ``extract`` runs inside a vLLM interpreter, started by ``releases``
(pyproject.toml: [tool.importlinter]).
"""
