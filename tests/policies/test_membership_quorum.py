"""membership_quorum: K where some island slots are elastic, hand-computed.

K = max(1, min(min_quorum, fixed_slots + elastic_members)): a fixed slot always counts (its dead island is
restarted), an elastic slot only while it holds an island; K is never raised and never below 1.
"""

import pytest

from policies.quorum import membership_quorum


@pytest.mark.parametrize("k, fixed, members, expected", [
    (3, 1, 2, 3),  # every slot held: K unchanged
    (3, 1, 1, 2),  # one elastic slot empty: K = all means the 2 islands the run has
    (3, 1, 0, 1),  # only the fixed island
    (1, 0, 5, 1),  # K = 1 stays 1 however many join
    (2, 4, 0, 2),  # enough fixed slots: K unchanged
    (6, 2, 3, 5),
    (4, 0, 0, 1),  # no island at all: at least 1
])
def test_golden(k, fixed, members, expected):
    assert membership_quorum(k, fixed_slots=fixed, elastic_members=members) == expected


def test_never_above_configured_k():
    for fixed in range(4):
        for members in range(4):
            assert membership_quorum(2, fixed_slots=fixed, elastic_members=members) <= 2


def test_grows_back_as_members_join():
    assert [membership_quorum(5, fixed_slots=1, elastic_members=m) for m in range(6)] == [1, 2, 3, 4, 5, 5]


@pytest.mark.parametrize("k, fixed, members", [(0, 1, 1), (-1, 1, 1), (2, -1, 1), (2, 1, -1)])
def test_bad_input_is_one_line_value_error(k, fixed, members):
    with pytest.raises(ValueError) as err:
        membership_quorum(k, fixed_slots=fixed, elastic_members=members)
    assert "\n" not in str(err.value) and f"min_quorum={k}" in str(err.value)


def test_arguments_after_k_are_keyword_only():
    with pytest.raises(TypeError):
        membership_quorum(3, 1, 1)  # type: ignore[misc]
