"""The redaction policy: what each field of each struct becomes, as data (``redaction.json``).

Actions: ``tokens`` (keyed, prefix-preserving token ids: ``tokens.py``),
``hash`` (strings and map keys keyed-hashed, so equal stays equal; numbers
kept), ``drop`` (the field's default), ``noise`` (tensors become keyed
pseudo-random tensors of the same shape and dtype; strings hashed), ``keep``
(as sent; a struct is walked with its own entry), and ``utility`` (a utility
answer: as the policy of the method that was called says).

Default deny: a field, map key or trailing position the policy does not name
is blanked and counted, never passed through. A user's ``--policy`` file is
laid over the shipped one, key by key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import msgspec

from replay_proxy.redact.tokens import RedactionError

Action = Literal["keep", "hash", "drop", "noise", "tokens", "utility"]
Part = Literal["args", "result"]
SHIPPED = Path(__file__).resolve().parent / "redaction.json"
ANY_METHOD = "*"


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    structs: dict[str, dict[str, Action]]  # struct -> field -> action
    handshake: dict[str, dict[str, Action]]  # HELLO / READY -> key -> action (INIT is a struct)
    utility: dict[str, dict[Part, Action]]  # method ("*": any other) -> what its args and its result become
    sessions: dict[str, Action]  # the ``sessions`` columns that hold text from outside

    @property
    def digest(self) -> str:
        """Names the policy in ``sessions.redaction_policy``: equal policies, equal digests."""
        return hashlib.sha256(msgspec.json.encode(self, order="sorted")).hexdigest()[:16]

    def utility_action(self, method: object, part: Part) -> Action:
        rules = self.utility.get(method, self.utility[ANY_METHOD]) if isinstance(method, str) \
            else self.utility[ANY_METHOD]
        return rules.get(part, "drop")


def _over(base: dict, changes: dict) -> dict:
    """``changes`` laid over ``base``, map by map."""
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = _over(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return merged


def load_policy(path: Path | None = None) -> Policy:
    """The shipped policy, with ``path``'s changes laid over it."""
    shipped = msgspec.json.decode(SHIPPED.read_bytes())
    changes = {}
    if path is not None:
        try:
            changes = msgspec.json.decode(Path(path).read_bytes())
        except OSError as exc:
            raise RedactionError(f"cannot read the redaction policy {path}: {exc.strerror}") from None
        except msgspec.DecodeError as exc:
            raise RedactionError(f"the redaction policy {path} is not JSON: {exc}") from None
    try:
        return msgspec.convert(_over(shipped, changes), Policy)
    except msgspec.ValidationError as exc:
        raise RedactionError(f"the redaction policy{f' {path}' if path else ''}: {exc}") from None
