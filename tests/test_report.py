"""Reports: JSON for machines, JUnit XML for CI, self-contained HTML for people."""

import json
import xml.etree.ElementTree as ET

from replay_proxy.compare.findings import Finding, Report, Severity
from replay_proxy.report.render import write_reports

REPORT = Report(
    title="diff", baseline="a", candidate="b",
    findings=[
        Finding("schema", Severity.BREAKING, "field_inserted", "EngineCoreOutput: inserted at 5",
                struct="EngineCoreOutput", field="finish_reason", position=5, breaks=("python-frontend",)),
        Finding("behaviour", Severity.REGRESSION, "token_mismatch", "tokens diverge at 2", request_id="r1"),
        Finding("behaviour", Severity.WARNING, "abort_progress", "aborted later", request_id="r2"),
    ],
    samples={"ttft_ms": {"baseline": [1.0, 2.0, 3.0], "candidate": [2.0, 4.0]}},
    schemas={"EngineCoreOutput": {"baseline": ["0 request_id: str"], "candidate": ["0 request_id: str", "1 x: int"]}},
    checks=["schema:EngineCoreOutput", "behaviour:r1", "behaviour:r2", "behaviour:r3"],
)


def test_json_report_lists_findings_worst_first_with_the_exit_code(tmp_path):
    write_reports(REPORT, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["exit_code"] == 3
    assert [f["code"] for f in data["findings"]] == ["field_inserted", "token_mismatch", "abort_progress"]
    assert data["findings"][0]["breaks"] == ["python-frontend"] and data["findings"][0]["position"] == 5


def test_junit_has_a_testcase_per_check_and_fails_only_regressions(tmp_path):
    write_reports(REPORT, tmp_path)
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "junit.xml").getroot()}
    behaviour = suites["behaviour"]
    cases = {c.get("name"): c for c in behaviour}
    assert set(cases) == {"r1", "r2", "r3"} and behaviour.get("failures") == "1"
    assert cases["r1"].find("failure").get("type") == "token_mismatch"
    assert cases["r2"].find("failure") is None and "aborted later" in cases["r2"].find("system-out").text
    assert suites["schema"].find("testcase/failure") is not None


def test_html_is_self_contained_with_plots_and_side_by_side_schemas(tmp_path):
    write_reports(REPORT, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "<svg" in page and "ttft_ms (CDF)" in page and "<polyline" in page
    assert "1 x: int" in page and 'class=\'diff\'' in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page
