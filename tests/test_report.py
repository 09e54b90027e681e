"""Reports: JSON for machines, JUnit XML for CI, self-contained HTML for people."""

import json
import xml.etree.ElementTree as ET

from replay_proxy.compare.findings import Finding, Report, Severity
from replay_proxy.report.render import print_summary, write_reports
from tests.helpers import REPORT


def test_json_report_lists_findings_worst_first_with_the_exit_code(tmp_path):
    write_reports(REPORT, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["exit_code"] == 3
    assert [f["code"] for f in data["findings"]] == ["field_inserted", "token_mismatch", "itl_regression",
                                                     "abort_progress", "ttft_no_change"]
    assert data["findings"][0]["breaks"] == ["python-frontend"] and data["findings"][0]["position"] == 5
    assert data["findings"][2]["change"] == {"relative": 0.2, "low": 0.12, "high": 0.29, "minimum_detectable": 0.08,
                                             "paired": True, "samples": [40, 40], "noise_runs": 0}


def test_junit_has_a_testcase_per_check_and_fails_only_regressions(tmp_path):
    write_reports(REPORT, tmp_path)
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "junit.xml").getroot()}
    behaviour = suites["behaviour"]
    cases = {c.get("name"): c for c in behaviour}
    assert set(cases) == {"r1", "r2", "r3"} and behaviour.get("failures") == "1"
    assert cases["r1"].find("failure").get("type") == "token_mismatch"
    assert cases["r2"].find("failure") is None and "aborted later" in cases["r2"].find("system-out").text
    assert suites["schema"].find("testcase/failure") is not None
    performance = {c.get("name"): c for c in suites["performance"]}
    assert set(performance) == {"itl_ms.p50", "ttft_ms.p50", "e2e_ms.p50"}
    assert suites["performance"].get("failures") == "1"
    assert "+20.0%" in performance["itl_ms.p50"].find("failure").get("message")
    assert "+2.0%" in performance["ttft_ms.p50"].find("system-out").text  # a passing metric keeps its numbers


def test_a_request_s_junit_testcase_lists_every_tier_that_judged_it(tmp_path):
    from replay_proxy.compare.findings import Judgement, RequestVerdict

    judged = (Judgement("same_context", True, "moved by up to 0"), Judgement("invariants", True, "4 tokens within"))
    report = Report(title="replay", baseline="a", candidate="b", findings=[], checks=["behaviour:r1"],
                    verdicts=[RequestVerdict("r1", "same_context", True, "moved by up to 0", judged)])
    write_reports(report, tmp_path)
    case = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite/testcase")
    assert case.get("name") == "r1" and case.find("failure") is None
    assert case.find("system-out").text == ("[same_context] passed: moved by up to 0\n"
                                            "[invariants] passed: 4 tokens within")


def test_the_summary_shows_every_estimate_with_its_interval_and_detectable_change():
    from rich.console import Console

    console = Console(record=True, width=160)
    print_summary(REPORT, console)
    text = console.export_text()
    assert "performance: change with 95% interval" in text
    assert "+20.0%" in text and "+12.0% .. +29.0%" in text and "regression" in text
    assert "ttft_ms.p50" in text and "no change" in text and "11.0%" in text  # shown without --all


def test_html_is_self_contained_with_plots_and_side_by_side_schemas(tmp_path):
    write_reports(REPORT, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "<svg" in page and "ttft_ms (CDF)" in page and "<polyline" in page
    assert "latency (ms)" in page and "fraction of samples" in page  # labelled axes, with ticks
    assert ">0.5</text>" in page and ">4</text>" in page
    forest = page[page.index("change per metric"):]
    assert forest.count("<circle") == 2 and "itl_ms.p50" in forest and "stroke-dasharray" in forest
    assert "1 x: int" in page and 'class=\'diff\'' in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page


def test_the_failures_a_rejection_caused_are_shown_under_it_in_every_form(tmp_path):
    from rich.console import Console

    caused = tuple(f"http_failed [r{i}]: the HTTP request failed: HTTP 500 decode failed" for i in range(5))
    report = Report(title="replay", baseline="a", candidate="b", findings=[Finding(
        "schema", Severity.BREAKING, "reader_rejected", "could not decode EngineCoreOutputs at position 8",
        struct="EngineCoreOutputs", position=8, consequences=caused)])
    write_reports(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["findings"][0]["consequences"] == list(caused)
    failure = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite/testcase/failure")
    assert all(c in failure.text for c in caused)
    page = (tmp_path / "report.html").read_text()
    assert "caused 5 failures" in page and "http_failed [r4]" in page
    console = Console(record=True, width=200)
    print_summary(report, console)
    text = console.export_text()
    assert "caused http_failed [r0]" in text and "and 2 more it caused" in text and "[r3]" not in text


def test_the_html_shows_each_request_s_verdict_groups_one_cause_and_plots_the_judging(tmp_path):
    from replay_proxy.compare.findings import Judgement, RequestVerdict

    mismatches = [Finding("behaviour", Severity.REGRESSION, "token_mismatch", f"tokens diverge at 0 of 4 ({k})",
                          request_id=f"r{k}", position=0, tier="exact") for k in range(12)]
    report = Report(title="replay", baseline="a", candidate="b", findings=mismatches,
                    verdicts=[RequestVerdict(f"r{k}", "exact", False, "tokens diverge") for k in range(12)]
                    + [RequestVerdict("s1", "same_context", True, "moved by up to 0", (
                        Judgement("same_context", True, "moved by up to 0"), Judgement("scored", True, "KL 0.0001")))],
                    kl={"noise floor": [0.0, 0.0001], "candidate": [0.0002, 0.0003]},
                    divergences={"r0": {"position": 0, "baseline": [-0.5, -0.2], "candidate": [-1.5, -0.3]}})
    write_reports(report, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert page.count("<td>token_mismatch</td>") == 1  # twelve findings of one cause: one row
    assert "<summary>12 requests</summary>" in page and "<li>r11</li>" in page
    assert "exact 12 (12 failed), same_context 1 (0 failed), scored 1 (0 failed); 13 requests, 12 failed" in page
    assert "<b>same_context</b> passed: moved by up to 0<br><b>scored</b> passed: KL 0.0001" in page  # every tier
    assert "teacher-forced KL per request (CDF)" in page and "diverging at position 0" in page
