"""replay-proxy: record and replay the ZeroMQ link between vLLM frontends and engines."""

__version__ = "0.1.0"
