"""Noise rules: the defaults, a --rules file over them, and a file that cannot be used (one line, exit 2)."""

import json

import pytest

from replay_proxy.compare.rules import RulesError, load_rules
from tests.helpers import ROOT, cli


def test_a_rules_file_replaces_the_keys_it_gives(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"_why": "a comment", "float_tolerance": 0.5,
                                "performance": {"min_relative_change": 0.2, "min_delta_ms": {"ttft_ms": 3}}}))
    rules, defaults = load_rules(path), load_rules()
    assert (rules.float_tolerance, rules.performance.min_relative_change, rules.performance.min_delta_ms) == (
        0.5, 0.2, {"ttft_ms": 3.0})
    assert rules.match_sampling_keys == defaults.match_sampling_keys  # the keys it does not give stay
    assert defaults.min_samples == {50: 3, 90: 10}


@pytest.mark.parametrize("content, said", [
    ({"percentile": [50]}, "unknown field `percentile`"),  # a typo is never silently ignored
    ({"performance": {"min_relative_change": 0.1, "min_delta": 1}}, "unknown field `min_delta`"),
    ({"float_tolerance": "tight"}, "Expected `float`"),
    ([1, 2], "expected a JSON object"),
])
def test_a_rules_file_that_cannot_be_used_is_a_clear_error(tmp_path, content, said):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RulesError, match=said.replace("`", ".")):
        load_rules(path)
    result = cli("diff", "--db", str(ROOT / "recordings" / "demo.db"), "--baseline", "1", "--candidate", "1",
                 "--rules", str(path))
    assert result.returncode == 1  # an input that cannot be used, as a --db is (docs/commands.md)
    assert len(result.stderr.strip().splitlines()) == 1 and said in result.stderr and "Traceback" not in result.stderr


def test_a_set_sent_as_a_list_in_another_order_is_the_same_result_for_the_methods_the_rules_name():
    """A pooling engine answered get_supported_tasks [embed, token_embed] in one process and [token_embed,
    embed] in the next (a set's order follows the hash seed): no finding. Another method's order counts."""
    from types import SimpleNamespace

    from replay_proxy.compare.behaviour import _utility_findings

    def session(*calls):
        return SimpleNamespace(utility=[{"method": m, "result": r, "failure_message": None} for m, r in calls])

    unordered = load_rules().unordered_utility_results
    recorded = session(("get_supported_tasks", '[null,["embed","token_embed"]]'), ("list_loras", "[null,[1,2]]"))
    replayed = session(("get_supported_tasks", '[null,["token_embed","embed"]]'), ("list_loras", "[null,[2,1]]"))
    [changed] = _utility_findings(recorded, replayed, False, unordered)
    assert (changed.code, changed.field) == ("utility_result_changed", "list_loras")
    other = session(("get_supported_tasks", '[null,["embed"]]'))
    assert [f.field for f in _utility_findings(recorded, other, False, unordered)][0] == "get_supported_tasks"


def test_a_section_s_keys_are_replaced_one_by_one(tmp_path):
    """A file written before ``performance.max_other_cpu`` existed still reads, and keeps that key's default."""
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"performance": {"min_relative_change": 0.2, "min_delta_ms": {"ttft_ms": 3}},
                                "judging": {"top_logprobs": 5}}))
    rules, defaults = load_rules(path), load_rules()
    assert rules.performance.max_other_cpu == defaults.performance.max_other_cpu
    assert (rules.judging.top_logprobs, rules.judging.min_kl) == (5, defaults.judging.min_kl)


def test_vocab_size_on_the_command_line_goes_over_the_rules_file(tmp_path):
    from replay_proxy.cli.common import rules_option

    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"judging": {"vocab_size": 32000, "min_kl": 0.002}}))
    assert (rules_option(path).judging.vocab_size, rules_option(path, 900).judging.vocab_size) == (32000, 900)
    assert rules_option(path, 900).judging.min_kl == 0.002 and load_rules().judging.vocab_size is None
