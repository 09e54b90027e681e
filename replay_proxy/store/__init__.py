"""The recording in SQLite: its tables, how frames become rows, and reading it back.

For others: ``recorder`` (``Recorder``, the relay's observer, with ``SessionInfo``,
``OnFull``, ``RecorderStats``), ``session`` (``load_session`` and
``decode_and_load``: one session as ``Session``; ``match_requests`` /
``request_key``; ``decode_kept``), ``queries`` (presets, ``run_query``,
``list_sessions``), ``tables`` (``open_database``, the layout), ``export``
(``export_parquet``), ``copy`` (``redact_database``), ``cut`` (``cut_database``
with a ``Selection``). ``writer`` and ``redactor`` are the recorder's
processes, ``protocol`` what they say to each other and ``rows`` the
writer's helper: store's own (pyproject.toml: [tool.importlinter]).
"""
