"""Rendering a ``compare.findings.Report``: a terminal summary, report.json, junit.xml, report.html.

For others: ``render.print_summary`` and ``render.write_reports``. It reads
nothing but the findings and the report it is given.
"""
