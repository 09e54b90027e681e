"""Hypothesis strategies the property tests share."""

from hypothesis import strategies as st

# Any value msgpack carries, nested: what a field of a frame may hold
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=30,
)
