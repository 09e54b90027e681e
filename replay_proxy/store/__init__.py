"""The recording in SQLite: its tables, how frames become rows, and reading it back.

For others: ``recorder`` (``Recorder``, the relay's observer, with ``SessionInfo``,
``OnFull``, ``RecorderStats``), ``session`` (``load_session`` and
``decode_and_load``: one session as ``Session``; ``match_requests`` /
``request_key``; ``decode_kept``), ``queries`` (presets, ``run_query``,
``list_sessions``), ``tables`` (``open_database``, the layout), ``export``
(``export_parquet``), ``copy`` (``redact_database``), ``cut`` (``cut_database``
with a ``Selection``), ``rotation`` (``RotationSettings``, ``first_file``,
``database_bytes``). The recorder's parts are store's own (pyproject.toml:
[tool.importlinter]): its ``tap``, its processes (``writer_process``,
``writer_loop``, ``writer``, ``redactor``, ``rotation.series``), what they
say to each other (``protocol``) and the writer's ``rows``.
"""
