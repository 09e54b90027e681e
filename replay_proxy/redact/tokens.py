"""Keyed, prefix-preserving pseudonymization of token ids, and the key behind all of redaction.

The token at position i of a sequence becomes ``pi_i(t)``, where ``pi_i`` is a
bijection of the vocabulary chosen by the key and the original tokens before
position i (Crypto-PAn's idea, for token ids instead of address bits):

* the context is keyed BLAKE2b of the tokens before position i (4 bytes
  each, little-endian), fed to one running hash a token at a time:
  ``state_i = BLAKE2b(key, t_0 .. t_{i-1})``; equal prefixes give equal
  states, across requests and sessions with one key. The running hash is
  ``_chain.Prefix``: hashlib.blake2b's digests, with its state in memory C
  reads per token without a call (``blake2b.h``);
* ``pi(t) = P[(t + shift) mod V]``: a shift drawn from the state (a one-time pad
  on the vocabulary, one per context) then ``P``, a secret permutation of the
  vocabulary drawn from the key, so the difference of two tokens that follow one
  prefix is not exposed either;
* the request's EOS and stop tokens are fixed points (``pi`` is walked along its
  cycle past them), so finish and stop reasons hold, and ``pi`` stays a
  bijection of the rest.

Hence: lengths are kept; two sequences that part at i still part at i; one
token in different contexts becomes different tokens, so there is no
substitution table to break by frequency. Token lists that belong to no
position (allowed ids, logit bias keys, bad words) go through the empty
context's bijection.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from pathlib import Path

from replay_proxy.errors import ReplayProxyError
from replay_proxy.redact import _chain

MIN_KEY_BYTES = 16
_DIGEST = 16  # bytes of each context's state
Prefix = _chain.Prefix  # a running keyed BLAKE2b: the tokens of a context so far


class RedactionError(ReplayProxyError):
    """A key, policy or vocabulary that redaction cannot work with."""


def _prf(key: bytes, purpose: bytes, data: bytes = b"", size: int = 32) -> bytes:
    return hashlib.blake2b(data, key=key, person=purpose, digest_size=size).digest()


class Key:
    """The redaction key: the subkeys of each use are derived from it, and only its fingerprint is stored."""

    def __init__(self, secret: bytes):
        if len(secret) < MIN_KEY_BYTES:
            raise RedactionError(f"the redaction key has {len(secret)} bytes; it needs {MIN_KEY_BYTES} or more "
                                 f"(make one with: head -c 32 /dev/urandom > redaction.key)")
        self._secret = secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()  # BLAKE2b keys: 64 bytes

    @classmethod
    def from_file(cls, path: str | Path) -> Key:
        try:
            return cls(Path(path).read_bytes().strip())
        except OSError as exc:
            raise RedactionError(f"cannot read the redaction key {path}: {exc.strerror}") from None

    def subkey(self, purpose: bytes) -> bytes:
        return _prf(self._secret, purpose)

    @property
    def fingerprint(self) -> str:
        """Names the key in ``sessions.redaction_key`` (it does not reveal it)."""
        return _prf(self._secret, b"fingerprint", size=8).hex()


class TokenMap:
    """The prefix-preserving bijections of one vocabulary under one key (see the module's docstring)."""

    def __init__(self, key: Key, vocab_size: int):
        if vocab_size < 2:
            raise RedactionError(f"a vocabulary of {vocab_size} tokens cannot be redacted")
        self.vocab_size = vocab_size
        self._root = Prefix(vocab_size.to_bytes(8, "little"), key=key.subkey(b"tokens"), person=b"context",
                            digest_size=_DIGEST)
        self.empty = self._root.digest()  # the context of the first token, and of token lists of no position
        order = key.subkey(b"token-order")
        self.permutation = sorted(range(vocab_size), key=lambda t: _prf(order, b"order", t.to_bytes(4, "little"), 8))

    def _refuse(self, tokens: Iterable[int]) -> None:
        bad = next((t for t in tokens if not (type(t) is int and 0 <= t < self.vocab_size)), tokens)
        raise RedactionError(f"token {bad!r} is not in a vocabulary of {self.vocab_size} (--vocab-size)")

    def _map(self, shifts: list[int], tokens: list[int], fixed: Collection[int]) -> list[int]:
        """Each token through its context's bijection (the shift drawn from its context)."""
        size, permutation = self.vocab_size, self.permutation
        mapped = []
        append = mapped.append
        for shift, token in zip(shifts, tokens):
            if token in fixed:
                append(token)
                continue
            out = permutation[(token + shift) % size]
            while out in fixed:  # along pi's cycle, past the fixed points: a bijection of the rest
                out = permutation[(out + shift) % size]
            append(out)
        return mapped

    def _check(self, tokens: list[int]) -> None:
        try:
            if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
                raise ValueError
        except (ValueError, TypeError):
            self._refuse(tokens)

    def start(self, salt: bytes = b"") -> Prefix:
        """A context before any token (``salt``: one that no sequence of tokens reaches)."""
        prefix = self._root.copy()
        if salt:
            prefix.update(b"\xff\xff\xff\xff" + salt)  # no token's 4 bytes start so: vocabularies are smaller
        return prefix

    def chain(self, prefix: Prefix, tokens: list[int], fixed: frozenset[int],
              states: list[bytes] | None = None) -> list[int]:
        """``tokens`` as they follow the context ``prefix``, which they extend: their redacted ids.

        ``states``, if given, gets the state before each token (the context its logprobs were drawn in).
        Each token's shift is drawn from the state before it (its first 8 bytes, little-endian), then its
        4 bytes extend the running hash; in C (``_chain.c``), a prompt's thousands of tokens at each ADD."""
        self._check(tokens)
        try:
            return _chain.chain(prefix, tokens, fixed, self.permutation, states)
        except TypeError:  # not an int
            self._refuse(tokens)

    @staticmethod
    def state(prefix: Prefix) -> bytes:
        """The context ``prefix`` stands for, as the bijection of its next token is drawn from it."""
        return prefix.digest()

    def at(self, state: bytes, tokens: list[int], fixed: Collection[int]) -> list[int]:
        """Each of ``tokens`` as a candidate in the one context ``state`` (logprobs, token lists)."""
        self._check(tokens)
        if not all(type(t) is int for t in tokens):
            self._refuse(tokens)
        return self._map([int.from_bytes(state[:8], "little")] * len(tokens), tokens, fixed)
