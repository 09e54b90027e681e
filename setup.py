"""The compiled forwarding loop (replay_proxy/net/_forward.c); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("replay_proxy.net._forward", ["replay_proxy/net/_forward.c"],
                             extra_compile_args=["-O2", "-Wall"])])
