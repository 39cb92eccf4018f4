"""Slurm host lists expanded as ``scontrol show hostnames`` does (slurm/hostlist.py). The expected
names are Slurm 22.05.8's output for each list (tests/faults/test_slurm.py also compares with a live
``scontrol``); what it refuses is one error naming the list."""

from __future__ import annotations

import pytest

from undying.slurm.hostlist import HostlistError, expand


@pytest.mark.parametrize(("hostlist", "names"), [
    ("n[1-3,5]", "n1 n2 n3 n5"),
    ("gpu-[01-10]", "gpu-01 gpu-02 gpu-03 gpu-04 gpu-05 gpu-06 gpu-07 gpu-08 gpu-09 gpu-10"),
    ("a[1-2]-b[3-4]", "a1-b3 a1-b4 a2-b3 a2-b4"),  # several brackets: the leftmost varies slowest
    ("x1,y[2-3]", "x1 y2 y3"),
    ("n[3,1]", "n3 n1"),  # the order given, not sorted
    ("n[8-10]", "n8 n9 n10"),  # padded to LOW's width as written
    ("n[08-10]", "n08 n09 n10"),
    ("n[009-011]", "n009 n010 n011"),
    ("n[01-3]", "n01 n02 n03"),
    ("n[1-03]", "n1 n2 n3"),
    ("rack[1-2]-node[01-02],login", "rack1-node01 rack1-node02 rack2-node01 rack2-node02 login"),
    ("n1,n1", "n1 n1"),  # duplicates kept
    ("n[1-2],m[3]", "n1 n2 m3"),
    ("node", "node"),
    ("n[0]", "n0"),
    ("n[1-2][3-4]", "n13 n14 n23 n24"),
    ("n-[1-2]", "n-1 n-2"),
    ("n[1-2],,n3", "n1 n2 n3"),  # empty items skipped
    ("x[1-2]y[3]", "x1y3 x2y3"),
    ("n5[1-2]", "n51 n52"),
    ("n[1,2-3,5-6]", "n1 n2 n3 n5 n6"),
])
def test_lists_expand_as_scontrol_shows_them(hostlist: str, names: str) -> None:
    assert expand(hostlist) == names.split()


def test_text_after_the_last_bracket_is_a_suffix() -> None:
    # Refused by scontrol 22.05 ("Invalid hostlist"), expanded so by later versions and other tools.
    assert expand("n[1-2]-ib,m") == ["n1-ib", "n2-ib", "m"]


@pytest.mark.parametrize(("hostlist", "why"), [
    ("n[1-3", "'[' without ']'"),
    ("n]", "']' without '['"),
    ("n[[1]]", "nested '['"),
    ("n[3-1]", "range '3-1' runs backwards"),
    ("n[a-b]", "'a-b' in brackets is not N or LOW-HIGH"),
    ("n[1-2,]", "'' in brackets is not N or LOW-HIGH"),
    ("n[1-99999999]", "more than 1000000 names"),
])
def test_what_is_not_a_host_list_is_one_error_naming_it(hostlist: str, why: str) -> None:
    with pytest.raises(HostlistError) as raised:
        expand(hostlist)
    assert str(raised.value) == f"host list {hostlist!r}: {why}"
