"""The token mapping's promises, over generated sequences: lengths, shared prefixes, partings, fixed points."""

import collections
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.redact.tokens import Key, Prefix, RedactionError, TokenMap

VOCAB = 64  # small: collisions and fixed points come up often
MAP = TokenMap(Key(b"k" * 32), VOCAB)
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=40)


def redacted(sequence, fixed=frozenset(), token_map=MAP):
    return token_map.chain(token_map.start(), sequence, fixed)


@settings(max_examples=300)
@given(tokens, tokens, tokens)
def test_equal_prefixes_stay_equal_and_sequences_part_where_they_parted(prefix, a, b):
    left, right = redacted(prefix + a), redacted(prefix + b)
    assert len(left) == len(prefix + a) and len(right) == len(prefix + b)
    assert left[:len(prefix)] == right[:len(prefix)]
    common = next((i for i, (x, y) in enumerate(zip(prefix + a, prefix + b)) if x != y), None)
    if common is not None:
        assert left[:common] == right[:common] and left[common] != right[common]


@settings(max_examples=200)
@given(tokens, st.frozensets(st.integers(0, VOCAB - 1), max_size=5))
def test_fixed_points_stay_and_nothing_else_becomes_one(sequence, fixed):
    for original, mapped in zip(sequence, redacted(sequence, fixed)):
        assert (original in fixed) == (mapped in fixed)
        if original in fixed:
            assert mapped == original


@settings(max_examples=200)
@given(tokens, tokens, st.frozensets(st.integers(0, VOCAB - 1), max_size=5))
def test_the_chain_in_c_is_the_construction_the_module_gives(prefix, sequence, fixed):
    """TokenMap.chain (in C) against the construction in Python: each token's shift from the state
    before it, then its 4 bytes extend the running hash. The same tokens, states and context after."""
    context, reference = MAP.start(), MAP.start()
    MAP.chain(context, prefix, fixed)
    MAP.chain(reference, prefix, fixed)
    states, reference_states, shifts = [], [], []
    redacted_ids = MAP.chain(context, sequence, fixed, states)
    for token in sequence:
        reference_states.append(reference.digest())
        shifts.append(int.from_bytes(reference_states[-1][:8], "little"))
        reference.update(token.to_bytes(4, "little"))
    assert redacted_ids == MAP._map(shifts, sequence, fixed)
    assert states == reference_states and context.digest() == reference.digest()


@settings(max_examples=300)
@given(st.binary(max_size=64), st.binary(max_size=16), st.integers(1, 64),
       st.lists(st.binary(max_size=300), max_size=6), st.integers(0, 6))
def test_the_running_hash_is_hashlibs_blake2b(key, person, digest_size, chunks, copied_at):
    """Prefix (blake2b.h) gives hashlib.blake2b's digests after every update, across block boundaries
    and from a copy, which goes on by itself."""
    ours, reference = Prefix(key=key, person=person, digest_size=digest_size), hashlib.blake2b(
        key=key, person=person, digest_size=digest_size)
    left_behind = reference_left_behind = None
    for i, chunk in enumerate(chunks):
        if i == copied_at:
            left_behind, ours = ours, ours.copy()
            reference_left_behind, reference = reference, reference.copy()
        ours.update(chunk)
        reference.update(chunk)
        assert ours.digest() == reference.digest()
    if left_behind is not None:
        assert left_behind.digest() == reference_left_behind.digest()


def test_a_key_redacts_tokens_as_it_did_before():
    """Recordings redacted with one key at different times stay comparable: these ids were made with the
    chain of hashlib.blake2b objects, before the running hash moved to C."""
    token_map = TokenMap(Key(b"k" * 32), 32000)
    redacted_ids = token_map.chain(token_map.start(salt=b"cmpl-1"), [t * 317 % 32000 for t in range(100)],
                                   frozenset({2}))
    assert token_map.empty.hex() == "9875dc37c94b8aa620c8de1cdb7e1032"
    assert redacted_ids[:8] == [21778, 26848, 26652, 15516, 10083, 20890, 13830, 27941]
    assert redacted_ids[-4:] == [16119, 1801, 10660, 2910]


@given(tokens, st.frozensets(st.integers(0, VOCAB - 1), max_size=5))
def test_each_context_maps_the_vocabulary_one_to_one(prefix, fixed):
    context = MAP.start()
    MAP.chain(context, prefix, fixed)
    assert sorted(MAP.at(MAP.state(context), list(range(VOCAB)), fixed)) == list(range(VOCAB))


def test_one_token_in_many_contexts_becomes_many_tokens():
    """No substitution table: token 7 after each of 64 different tokens lands on most of the vocabulary."""
    landed = collections.Counter(redacted([p, 7])[1] for p in range(VOCAB))
    assert len(landed) > VOCAB // 2


def test_the_key_chooses_the_mapping_and_one_key_always_gives_the_same():
    sequence = list(range(30))
    assert redacted(sequence) == redacted(sequence, token_map=TokenMap(Key(b"k" * 32), VOCAB))
    assert redacted(sequence) != redacted(sequence, token_map=TokenMap(Key(b"j" * 32), VOCAB))


@pytest.mark.parametrize("bad", [[VOCAB], [-1], [1.5], ["3"]])
def test_a_token_outside_the_vocabulary_is_refused_by_name(bad):
    with pytest.raises(RedactionError, match="not in a vocabulary of 64"):
        redacted([1, *bad])


def test_a_short_key_is_refused():
    with pytest.raises(RedactionError, match="needs 16 or more"):
        Key(b"short")
