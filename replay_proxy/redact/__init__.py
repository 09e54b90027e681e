"""Redaction, sans-IO: a recorded session made safe to hand on, and still faithful to the engine.

For others: ``settings`` (``RedactionSettings``, what a command was given, and
``Redaction``, the loaded key, policy and vocabulary: a ``Redactor`` per
session and the redacted ``sessions`` row). ``frames`` (the ``Redactor``:
frames in, redacted frames out), ``policy`` (``redaction.json``) and the token
mapping of ``tokens`` are the package's own (pyproject.toml: [tool.importlinter]).
"""
