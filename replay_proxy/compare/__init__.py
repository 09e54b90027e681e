"""Comparing: two loaded sessions, or two release schemas, in; findings out.

For others: ``report`` (``build_report``, ``diff_sessions``, ``schema_report``),
``findings`` (``Finding``, ``Report``, ``Severity``, ``exit_code``), ``codes``
(``Code``: every finding's code, an enum), ``rules``
(``Rules``, ``load_rules``), ``schema_diff`` (``diff_schemas``, ``readers``),
``readers`` (the readers' rules, which the matrix predicts with),
``schema_history`` (``struct_history``), ``behaviour``'s ``batched`` and
``tokens``' ``deterministic`` (which requests reproduce, for the matrix's
observation). ``schema``, ``sampling``, ``performance`` and ``scoring`` are
kinds of finding that only ``report`` gathers (pyproject.toml:
[tool.importlinter]); ``behaviour`` judges each request with ``tokens``.
"""
