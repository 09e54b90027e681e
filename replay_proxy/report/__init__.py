"""Rendering: a report, the matrix, and rows for the terminal. It reads nothing but what it is given.

For others: ``render`` (``print_summary``, ``write_reports``: a
``compare.findings.Report`` as a terminal summary, report.json, junit.xml,
report.html), ``matrix`` (the cells as a table, JSON, JUnit, an HTML heat map
and markdown; can-i-deploy's answer), ``tables`` (query rows, a schema
history).
"""
