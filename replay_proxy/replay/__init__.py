"""Replay: play one side of a recorded session against a new build of the other, then compare.

For others: ``run.replay_session`` (what ``replay-proxy replay`` calls) and
``Against``; the players (``play_frontend.FrontendPlayer``,
``play_engine.EnginePlayer``) and ``player.ReplayOutcome`` for benchmarks.
"""

import enum


class Against(enum.StrEnum):
    """The peer under test; the proxy plays the other side."""

    ENGINE = "engine"
    FRONTEND = "frontend"
