"""Prompts as text, for a frontend under test that takes no token ids (smg answers a token-id prompt with HTTP 400).

The recorded prompt is detokenized with the model's own tokenizer (its
``tokenizer.json``, read by Hugging Face's ``tokenizers``: the library
vLLM's and smg's tokenizers are), and the player judges the request the
frontend makes of it token for token against the recorded one. Where the
text does not encode back to the recorded tokens (a byte-level BPE merges
differently, a special token's text), the request is matched through the
tokens this tokenizer gives it, and the difference is named a
re-tokenization, not the frontend's. A redacted recording's tokens are
pseudonyms: its prompts have no text, and it needs a frontend that takes
token-id prompts.
"""

from __future__ import annotations

import enum
from pathlib import Path

from replay_proxy.errors import ReplayProxyError

TOKENIZER_FILE = "tokenizer.json"


class PromptForm(enum.StrEnum):
    """How a frontend under test is sent the recorded prompts (``replay --prompts``)."""

    AUTO = "auto"  # as token ids; as text from the first request the frontend rejects for its prompt on
    TOKENS = "tokens"
    TEXT = "text"


class TokenizerError(ReplayProxyError):
    """The model's tokenizer cannot be read."""


class Texts:
    """The model's tokenizer, both ways."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer at {path} (a {TOKENIZER_FILE}, or a model folder holding one): "
                              "give the model's with --tokenizer")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot read
            raise TokenizerError(f"{file} is not a tokenizer: {exc}") from None
        self.path = file

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def rejects_token_prompts(error: str | None) -> bool:
    """Whether an HTTP failure is a frontend refusing a prompt given as token ids: a 400 that names the prompt and
    its type (smg: "prompt: data did not match any variant of untagged enum StringOrArray", "invalid_type"), not
    one that refuses what the prompt holds (too long)."""
    return error is not None and error.startswith("HTTP 400") and "prompt" in error and any(
        words in error for words in ("did not match", "invalid_type", "must be a string"))
