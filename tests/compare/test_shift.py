"""A session's paired shift against the same build's spread: the sign-flip interval."""

from replay_proxy.compare.shift import mean_interval, paired_shift

# The same build, replayed beside another replay (scripts/bench/verdicts.py, trained model, run 9 of 20): each
# sampled request's mean logprob shift against the baseline run. 18 reproduced exactly; of the 10 that did not,
# 9 moved down, a few by a long way (a peaked model's unlikely samples).
SAME_BUILD = [0.0] * 10 + [-0.44, -0.125, 0.1, -0.771, -0.143, -0.416, -1.231, -0.846, -0.302, -0.217] + [0.0] * 8


def test_the_same_builds_long_tailed_shifts_are_not_a_regression_though_a_bootstrap_called_them_one():
    shift = paired_shift(SAME_BUILD, [])
    assert not shift.beyond and shift.low < 0 < shift.high
    _, _, bootstrap_high = mean_interval(SAME_BUILD, 3.29)
    assert bootstrap_high < 0  # (what the gate once said: a regression in 1 of 20 same-build replays)


def test_a_shift_every_differing_request_shares_is_a_regression():
    moved = [value - 0.3 if value else value for value in SAME_BUILD[:10]] + [-0.3 - 0.01 * k for k in range(18)]
    shift = paired_shift(moved, [])
    assert shift.beyond and shift.high < 0


def test_repeat_runs_that_move_the_mean_as_much_widen_the_interval_past_it():
    moved = [-0.1 - 0.001 * k for k in range(20)]
    assert paired_shift(moved, []).beyond
    assert not paired_shift(moved, [0.08, -0.09]).beyond
