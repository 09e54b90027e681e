"""The project's one exception base; subclasses live beside their raisers."""


class ReplayProxyError(Exception):
    """A user-facing error: bad input, bad configuration, a peer that broke the protocol."""
