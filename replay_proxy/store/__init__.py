"""The recording file: its layout, how frames become rows, reading it back, and what is done to a file.

For others: ``session`` (``load_session`` and ``decode_and_load``: one session as ``Session``;
``match_requests`` / ``request_key``; ``decode_kept``), ``queries`` (presets, ``run_query``,
``list_sessions``), ``tables`` (``open_database``, ``read_recording``, the layout), ``files``
(``open_read_only``), ``export`` (``export_parquet``), ``copy`` (``redact_database``, ``copy_session``),
``cut`` (``cut_database`` with a ``Selection``), ``sample`` (``RequestSample``), ``counts`` (where every
frame is). The writer of a file (``writer``: frames into rows, ``rows``; what it reports, ``progress``) is
the recorder's (``replay_proxy/recorder/``) and the file operations' alone (pyproject.toml:
[tool.importlinter]).
"""
