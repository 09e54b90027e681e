"""The recording in SQLite: its tables, how frames become rows, and reading it back.

For others: ``recorder`` (``Recorder``, the relay's observer, with ``SessionInfo``,
``OnFull``, ``RecorderStats``), ``session`` (``load_session``: one session as
``Session``, and ``match_requests`` / ``request_key``), ``queries`` (presets,
``run_query``, ``list_sessions``), ``tables`` (``open_database``, the layout).
``writer`` is the recorder's process and ``rows`` its helper.
"""
