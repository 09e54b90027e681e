"""Finding codes are an enum: every family a code is built from has its members, and a misspelt one fails."""

import msgspec
import pytest

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.compare.performance import LATENCIES
from replay_proxy.compare.sampling import SAMPLING_KINDS


def test_every_sampling_kind_has_its_code():
    for kind in SAMPLING_KINDS:
        assert Code(f"sampling_key_{kind.replace(' ', '_')}").name.startswith("SAMPLING_KEY_")


def test_every_metric_has_a_code_for_each_outcome():
    names = [m.removesuffix("_ms") for m in LATENCIES] + ["throughput"]
    for name in names:
        for outcome in ("regression", "improvement", "no_change"):
            Code(f"{name}_{outcome}")


def test_a_misspelt_code_fails_where_it_is_made():
    with pytest.raises(ValueError):
        Code("ttft_regresion")
    with pytest.raises(AttributeError):
        getattr(Code, "TOKEN_MISMATCHED")


def test_a_code_is_its_name_in_a_report():
    finding = Finding("behaviour", Severity.REGRESSION, Code.TOKEN_MISMATCH, "differs")
    assert msgspec.json.decode(msgspec.json.encode(finding))["code"] == "token_mismatch"
    assert f"{finding.code}" == "token_mismatch" and finding.code == "token_mismatch"
