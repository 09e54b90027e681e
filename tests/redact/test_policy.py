"""The shipped policy names every field of every shipped release, and nothing else."""

import json

import pytest

from replay_proxy.redact.policy import load_policy
from replay_proxy.redact.tokens import RedactionError
from replay_proxy.wire.registry import load_schema, shipped_releases


def test_every_field_of_every_shipped_release_has_an_action_and_every_action_a_field():
    policy = load_policy()
    fields = {}
    for release in shipped_releases():
        for name, struct in load_schema(release).structs.items():
            fields.setdefault(name, set()).update(f.name for f in struct.fields)
    missing = {s: sorted(names - set(policy.structs.get(s, {}))) for s, names in fields.items()}
    assert {s: m for s, m in missing.items() if m} == {}  # else a current field would be blanked
    unused = {s: sorted(set(rules) - fields.get(s, set())) for s, rules in policy.structs.items()}
    assert {s: u for s, u in unused.items() if u} == {}  # a key nothing reads


def test_a_policy_file_is_laid_over_the_shipped_one(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"structs": {"SamplingParams": {"structured_outputs": "keep"}}}))
    policy = load_policy(path)
    assert policy.structs["SamplingParams"]["structured_outputs"] == "keep"
    assert policy.structs["SamplingParams"]["stop"] == "drop"  # the rest as shipped
    assert policy.digest != load_policy().digest


@pytest.mark.parametrize("text, error", [("{", "not JSON"), ('{"structs": {"SamplingParams": {"stop": "erase"}}}',
                                                           "Invalid enum value 'erase'")])
def test_a_policy_that_cannot_be_used_says_why(tmp_path, text, error):
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(RedactionError, match=error):
        load_policy(path)
