"""Replay: play one side of a recorded session against a new build of the other, then compare.

For others: ``run.replay_session`` (what ``replay-proxy replay`` calls), with
``player.PeerUnderTest`` (the new build, named by its ``wire.messages.Side``)
and ``player.ReplayOptions``; the players (``play_frontend.FrontendPlayer``
plays the recorded frontend to an engine, ``play_engine.EnginePlayer`` the
recorded engines to a frontend: replay's own in the package, pyproject.toml:
[tool.importlinter]; the benchmarks drive them) and ``player.ReplayOutcome``;
``shrink.shrink`` (what ``replay-proxy shrink`` calls: ddmin over a session's
requests, each candidate a cut replayed in a process of its own).
"""
