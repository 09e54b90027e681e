"""What redaction was given (a key file, a policy, the vocabulary size) and what it makes of a session."""

from __future__ import annotations

from typing import Any

import msgspec

from replay_proxy.redact.frames import Hasher, Redactor
from replay_proxy.redact.policy import load_policy
from replay_proxy.redact.tokens import Key
from replay_proxy.wire.values import to_json


class RedactionSettings(msgspec.Struct, frozen=True):
    """As given on the command line; the writer process loads the key from its file (never from argv)."""

    key_file: str
    vocab_size: int
    policy_file: str | None = None


class Redaction:
    """The loaded key and policy: a ``Redactor`` for each session, and what its ``sessions`` row says."""

    def __init__(self, settings: RedactionSettings):
        self.key = Key.from_file(settings.key_file)
        self.policy = load_policy(settings.policy_file)
        self.vocab_size = settings.vocab_size
        self._hasher = Hasher(self.key)

    def redactor(self, vllm_version: str | None) -> Redactor:
        return Redactor(self.key, self.policy, self.vocab_size, vllm_version)

    def session_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """A ``sessions`` row with its outside text redacted, saying how (policy digest, key fingerprint)."""
        redacted = dict(row)
        for column, action in self.policy.sessions.items():
            if isinstance(row.get(column), str):
                redacted[column] = row[column] if action == "keep" else \
                    self._hasher.text(row[column]) if action == "hash" else None
        return {**redacted, "redaction_policy": self.policy.digest, "redaction_key": self.key.fingerprint}


def redaction_counts(redactor: Redactor) -> str | None:
    """What a session's redaction blanked (default deny) and dropped (the policy), for ``sessions``."""
    counts = {"blanked": dict(redactor.blanked), "dropped": dict(redactor.dropped),
              "outputs_without_prompt": redactor.outputs_without_prompt}
    return to_json({k: v for k, v in counts.items() if v})
