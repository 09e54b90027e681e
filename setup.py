"""The compiled parts: the forwarding loop (replay_proxy/net/_forward.c) and redaction's token chain, with
a busy engine's outputs (replay_proxy/redact/_chain.c); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(name, [source], extra_compile_args=["-O2", "-Wall"]) for name, source in (
    ("replay_proxy.net._forward", "replay_proxy/net/_forward.c"),
    ("replay_proxy.redact._chain", "replay_proxy/redact/_chain.c"))])
