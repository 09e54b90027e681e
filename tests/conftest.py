import pytest

from replay_proxy.net.relay import Relay
from replay_proxy.sim.engine import SimEngine
from replay_proxy.sim.frontend import SimFrontend
from replay_proxy.store.recorder import Recorder, SessionInfo


class RecordedSession:
    """Sim frontend <-> relay (recording) <-> sim engines, in one nursery."""

    def __init__(self, nursery, db, engines=1, api_servers=1, engine_drift=None, frontend_drift=None,
                 name="test", coordinator=False, record_coordinator=False, frontend_release="0.32.0",
                 engine_release="0.32.0", **recorder_options):
        self.nursery, self.db, self.name = nursery, db, name
        self.frontend_release, self.engine_release = frontend_release, engine_release
        self.n_engines, self.api_servers = engines, api_servers
        self.engine_drift, self.frontend_drift = engine_drift, frontend_drift
        self.coordinator, self.record_coordinator = coordinator, record_coordinator
        self.recorder_options = recorder_options  # on_full, queue_size

    async def start(self):
        kwargs = {"drift": self.frontend_drift} if self.frontend_drift else {}
        self.frontend = SimFrontend(engines=self.n_engines, api_servers=self.api_servers,
                                    coordinator=self.coordinator, release=self.frontend_release, **kwargs)
        upstream = await self.nursery.start(self.frontend.run)
        self.recorder = Recorder(self.db, SessionInfo(name=self.name, upstream=upstream), **self.recorder_options)
        self.relay = Relay("tcp://127.0.0.1:0", upstream, self.recorder, record_coordinator=self.record_coordinator)
        self.nursery.start_soon(self.relay.run)
        await self.relay.listening.wait()
        kwargs = {"drift": self.engine_drift} if self.engine_drift else {}
        self.engines = [SimEngine(self.relay.listen, i, release=self.engine_release, **kwargs)
                        for i in range(self.n_engines)]
        for engine in self.engines:
            self.nursery.start_soon(engine.run)
        await self.frontend.ready.wait()
        return self


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "recording.db"


@pytest.fixture
async def session_factory(nursery, db_path):
    async def make(**kwargs):
        return await RecordedSession(nursery, db_path, **kwargs).start()
    return make


def pytest_addoption(parser):
    parser.addoption("--release-matrix", action="store_true",
                     help="also run the tests of every release (release_matrix), installing each on demand")


# The test files whose real peers take the longest (in this order, about 10, 5, 4, 5, 4, 3 and 3 minutes of one
# worker), run first so that both workers stay busy to the end (scripts/test.sh: xdist, a file a worker).
LONGEST_FIRST = ("test_matrix_vllm.py", "test_dp_vllm.py", "test_record_vllm.py", "test_replay_engine_vllm.py",
                 "test_verdicts_vllm.py", "test_lora_vllm.py", "test_shrink_vllm.py")


def pytest_collection_modifyitems(config, items):
    """The longest real-vLLM files first; the release matrix only when asked for; real-vLLM tests skip
    when the peers are not installed, unless scripts/test.sh said they are."""
    import os

    from tests.real.peers import installed

    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every other test keeps its place
    if not config.getoption("--release-matrix"):
        matrix = [item for item in items if "release_matrix" in item.keywords]
        config.hook.pytest_deselected(items=matrix)
        items[:] = [item for item in items if "release_matrix" not in item.keywords]
    if installed():
        return
    if os.environ.get("REPLAY_PROXY_REQUIRE_VLLM"):
        raise pytest.UsageError("real vLLM peers missing: scripts/setup-vllm.sh did not install them")
    skip = pytest.mark.skip(reason="real vLLM not installed: run scripts/setup-vllm.sh (scripts/test.sh does)")
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With the peers installed (REPLAY_PROXY_REQUIRE_VLLM), a real-vLLM test that skips has lost its
    coverage without saying so: it fails instead."""
    import os

    outcome = yield
    report = outcome.get_result()
    if report.skipped and "real_vllm" in item.keywords and os.environ.get("REPLAY_PROXY_REQUIRE_VLLM"):
        report.outcome = "failed"
        report.longrepr = f"a real-vLLM test skipped although the peers are installed: {report.longrepr}"
