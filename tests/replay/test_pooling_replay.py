"""Against a new frontend, a pooling request is asked again as an embedding of its prompt, and what the user
gets is compared value by value with what the recorded engine pooled (recordings/vllm-0.32.0-python-pooling.db,
made through the recorder between a real 0.32.0 pooling frontend and engine). Nothing is started here."""

from replay_proxy.matrix import RECORDINGS
from replay_proxy.replay.play_engine import EnginePlayer
from replay_proxy.replay.player import ReplayOptions, UserSaw
from replay_proxy.store.session import load_session


def test_an_embedding_that_is_not_what_the_engine_pooled_is_found():
    session = load_session(RECORDINGS / "vllm-0.32.0-python-pooling.db", "python-frontend")
    player = EnginePlayer(session, "tcp://127.0.0.1:9", "http://127.0.0.1:9", None, ReplayOptions())  # (no peer)
    pooled = {o["request_id"]: o["pooling_output"].values for f in session.outputs
              for o in (f.decoded or {}).get("outputs") or [] if o.get("pooling_output") is not None}
    adds = [f.decoded["request_id"] for f in player._adds]
    assert len(adds) == 5 and set(adds) <= set(pooled) and all(len(pooled[r]) == 128 for r in adds)
    for rid in adds:  # every user got what was pooled
        player.outcome.http[rid] = UserSaw(embedding=list(pooled[rid]))
    assert player._request_findings() == []
    player.outcome.http[adds[2]].embedding[7] += 1e-3  # one value of one embedding
    [finding] = player._request_findings()
    assert (finding.code, finding.request_id) == ("http_response_differs", adds[2])
    assert "embedding of 128 values" in finding.message
