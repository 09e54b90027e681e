import os
from pathlib import Path

import pytest

# GNU readline, loaded into this process, exports COLUMNS=80 (and LINES) to every child it starts, and piped output
# is as wide as COLUMNS says: the suite's children print as to a program reading a pipe with no COLUMNS, 200 wide.
os.environ["COLUMNS"] = "200"

# The helper modules' asserts say what they compared, as a test module's do (named before they are imported).
pytest.register_assert_rewrite("tests.helpers", "tests.real.vllm_reads", "tests.replay.sim_sessions",
                               "tests.replay.paced")

from tests.helpers import RecordedSession  # noqa: E402


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "recording.db"


@pytest.fixture
def recording_copy(tmp_path):
    """A copy of the committed demo recording, to be changed (or shown not to be)."""
    import shutil

    return Path(shutil.copy(Path(__file__).parents[1] / "recordings" / "demo.db", tmp_path / "demo.db"))


@pytest.fixture
async def session_factory(nursery, db_path):
    async def make(**kwargs):
        return await RecordedSession(nursery, db_path, **kwargs).start()
    return make


def pytest_addoption(parser):
    parser.addoption("--release-matrix", action="store_true",
                     help="also run the tests of every release (release_matrix), installing each on demand")


# The test files that take the longest, run first so that both workers stay busy to the end (scripts/test.sh:
# xdist): those whose real peers do (in this order, about 10, 8, 5, 4, 5, 3 and 3 minutes of one worker, a file a
# worker), then the part without vLLM's (about a minute each), which would otherwise come last, one worker idle.
LONGEST_FIRST = ("test_matrix_vllm.py", "test_verdicts_vllm.py", "test_dp_vllm.py", "test_record_vllm.py",
                 "test_replay_engine_vllm.py", "test_lora_vllm.py", "test_shrink_vllm.py",
                 "test_shrink_sim.py", "test_performance_replay_sim.py", "test_rows.py", "test_soak.py",
                 "test_wheel.py", "test_rotation.py", "test_shard_sim.py")


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
