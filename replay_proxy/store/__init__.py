"""The recording in SQLite: its tables, how frames become rows, and reading it back.

For others: ``recorder`` (``Recorder``, the relay's observer, with ``SessionInfo``,
``OnFull``, ``RecorderStats``), ``session`` (``load_session`` and
``decode_and_load``: one session as ``Session``; ``match_requests`` /
``request_key``; ``decode_kept``), ``queries`` (presets, ``run_query``,
``list_sessions``), ``tables`` (``open_database``, the layout), ``export``
(``export_parquet``). ``writer`` is the recorder's process, ``protocol`` what
the two say to each other and ``rows`` the writer's helper: store's own
(pyproject.toml: [tool.importlinter]).
"""
