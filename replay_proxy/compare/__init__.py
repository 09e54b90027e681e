"""Comparing: two loaded sessions, or two release schemas, in; findings out.

For others: ``report`` (``build_report``, ``schema_report``), ``findings``
(``Finding``, ``Report``, ``Severity``, ``exit_code``), ``rules`` (``load_rules``),
``schema_diff`` (``diff_schemas``, ``readers``). ``schema``, ``sampling``,
``behaviour`` and ``performance`` are the kinds of finding ``report`` gathers.
"""
