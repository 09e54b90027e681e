"""Sockets: the relay between a frontend and its engines, and the C loop that forwards for it.

For others: ``relay`` (``Relay``, its ``Observer`` protocol, ``local_address_like``),
``zmq_socket`` (``ZmqSocket``, a pyzmq socket driven by trio). ``loop`` and
``_forward`` are the relay's own (pyproject.toml: [tool.importlinter]).
"""
