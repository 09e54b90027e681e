"""The recorder's runtime: the relay's observer and the processes that write what it saw.

``Recorder`` (``recorder``: a thin ``Observer`` over the tap and the writer process, with ``SessionInfo``,
``OnFull``, ``RecorderStats``), its tap thread (``tap``), the writer process as the proxy sees it
(``writer_process``) and as it runs (``writer_loop``), the redactor process between them when recording
redacted (``redactor``), what they say to each other (``protocol``), and rotation (``rotation/``:
``RotationSettings``, ``first_file``, ``database_bytes``). Below it, ``store/`` is the file they write; above
it, ``record`` and ``replay`` use it. Its processes and protocol are its own (pyproject.toml:
[tool.importlinter]).
"""

from replay_proxy.recorder.recorder import OnFull, Recorder, RecorderStats, SessionInfo

__all__ = ["OnFull", "Recorder", "RecorderStats", "SessionInfo"]
