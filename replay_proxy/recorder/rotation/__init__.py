"""``record --rotate-mb / --rotate-every / SIGHUP`` and ``--keep / --max-total-gb``: when to rotate and what
(``rotator``, sans-IO), the files on disk (``files``), and the writer process's series of them (``series``)."""

from replay_proxy.recorder.rotation.files import database_bytes, first_file
from replay_proxy.recorder.protocol import RotationSettings

__all__ = ["RotationSettings", "database_bytes", "first_file"]
