"""--inject parsing, its env-var round trip, target checks, and which worker an injection fires in."""

from __future__ import annotations

import time

import pytest

from undying.inject import (
    SYNTAX,
    InjectedFault,
    Injection,
    InjectionSpecError,
    check_targets,
    decode,
    encode,
    fire,
    parse_injection,
    parse_injections,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kill:rank=1:step=5", Injection(0, "kill", 5, rank=1)),
        ("hang:rank=0:step=0", Injection(0, "hang", 0, rank=0)),
        ("raise:rank=3:step=12", Injection(0, "raise", 12, rank=3)),
        ("node:node=1:step=7", Injection(0, "node", 7, node=1)),
        ("kill:step=5:rank=1", Injection(0, "kill", 5, rank=1)),
        ("node:node=1:step=15:committed=10", Injection(0, "node", 15, node=1, committed=10)),
        ("kill:rank=0:at=recovery:committed=0", Injection(0, "kill", None, rank=0, at="recovery", committed=0)),
        ("  kill:rank=1:step=5\n", Injection(0, "kill", 5, rank=1)),
        ("kill:rank=2:step=4:at=allreduce", Injection(0, "kill", 4, rank=2, at="allreduce")),
        ("hang:rank=0:at=after_vote", Injection(0, "hang", None, rank=0, at="after_vote")),
        ("raise:rank=1:step=9:at=optimizer", Injection(0, "raise", 9, rank=1, at="optimizer")),
        ("node:node=1:step=7:at=after_vote", Injection(0, "node", 7, node=1, at="after_vote")),
    ],
)
def test_parse_each_kind(text, expected):
    assert parse_injection(text) == expected


def test_parse_keeps_the_index_and_text_round_trips():
    texts = ["kill:rank=1:step=5", "node:node=0:step=9", "hang:rank=2:step=3", "raise:rank=0:step=1",
             "node:node=1:step=15:down=2:committed=10"]
    injections = parse_injections(texts)
    assert [injection.index for injection in injections] == [0, 1, 2, 3, 4]
    assert [injection.text() for injection in injections] == texts
    for injection in injections:
        assert parse_injection(injection.text(), injection.index) == injection


def test_encode_decode_round_trip():
    injections = parse_injections(["kill:rank=1:step=5", "node:node=1:step=2", "raise:rank=0:step=30"])
    text = encode(injections)
    assert text == "kill:rank=1:step=5;node:node=1:step=2;raise:rank=0:step=30"
    assert decode(text) == injections


def test_decode_of_nothing_is_no_injections():
    assert decode(None) == []
    assert decode("") == []
    assert encode([]) == ""
    assert decode(";kill:rank=0:step=1;;") == [Injection(0, "kill", 1, rank=0)]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "explode:rank=0:step=1",
        "KILL:rank=0:step=1",
        "kill",
        "kill:rank=0",
        "kill:step=1",
        "kill:rank:step=1",
        "kill:rank=:step=1",
        "kill:rank=x:step=1",
        "kill:rank=1.5:step=1",
        "kill:rank=+1:step=1",
        "kill:rank=--1:step=1",
        "kill:rank=\u00b2:step=1",
        "kill:rank=0:step=1:step=2",
        "kill:rank=0:step=1:node=0",
        "kill:node=0:step=1",
        "node:rank=0:step=1",
        "node:node=0:rank=0:step=1",
        "kill:rank=-1:step=1",
        "kill:rank=0:step=-2",
        "node:node=-1:step=0",
        "node:node=1:step=15:committed=-1",
        "node:node=1:step=15:committed=",
        "kill:rank=0:step=1:committed=1:committed=2",
        "kill: rank=0:step=1",
        "kill:rank=0\n:step=1",
        "kill:rank=0:step=1:at=backward",
        "kill:rank=0:step=1:at=after_vote:at=optimizer",
    ],
)
def test_every_bad_spec_is_a_one_line_error_naming_the_syntax(text):
    with pytest.raises(InjectionSpecError) as raised:
        parse_injection(text)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("--inject ")
    assert SYNTAX in message


def test_a_bad_spec_among_many_is_reported():
    with pytest.raises(InjectionSpecError, match="oops"):
        parse_injections(["kill:rank=0:step=1", "oops"])


def test_check_targets_accepts_what_the_job_has():
    check_targets(parse_injections(["kill:rank=3:step=1", "node:node=1:step=1"]), world_size=4, nnodes=2)
    check_targets([], world_size=1, nnodes=1)


@pytest.mark.parametrize(
    ("text", "limit"),
    [("kill:rank=4:step=1", "rank must be < world size (4)"),
     ("hang:rank=9:step=1", "rank must be < world size (4)"),
     ("node:node=2:step=1", "node must be < nnodes (2)")],
)
def test_check_targets_refuses_ranks_and_nodes_the_job_lacks(text, limit):
    with pytest.raises(InjectionSpecError) as raised:
        check_targets(parse_injections(["kill:rank=0:step=1", text]), world_size=4, nnodes=2)
    message = str(raised.value)
    assert limit in message and text in message and "\n" not in message


def test_a_rank_injection_fires_on_its_rank_at_its_step_only():
    injection = parse_injection("kill:rank=3:step=5")
    assert injection.targets(rank=3, node=1, local_rank=1, step=5)
    assert not injection.targets(rank=3, node=1, local_rank=1, step=4)
    assert not injection.targets(rank=3, node=1, local_rank=1, step=6)
    assert not injection.targets(rank=2, node=1, local_rank=0, step=5)


def test_a_node_injection_fires_on_its_nodes_local_rank_zero_only():
    injection = parse_injection("node:node=1:step=7")
    assert injection.targets(rank=2, node=1, local_rank=0, step=7)
    assert not injection.targets(rank=3, node=1, local_rank=1, step=7)
    assert not injection.targets(rank=0, node=0, local_rank=0, step=7)
    assert not injection.targets(rank=2, node=1, local_rank=0, step=8)


def test_a_raise_injection_raises_in_the_caller():
    with pytest.raises(InjectedFault, match="raise:rank=0:step=2"):
        fire(parse_injection("raise:rank=0:step=2"))


class _Reporter:
    """What InjectionPoints needs of the worker's reporter: the claim and the event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None, dict]] = []

    def claim_injection(self, index: int, step: int) -> bool:
        return True

    def emit(self, kind: str, step: int | None = None, **details) -> None:
        self.events.append((kind, step, details))


def test_a_committed_injection_waits_for_its_checkpoint_before_firing():
    """``committed=10``: the injection is not fired until the checkpoint of step 10 is committed."""
    from undying.runtime.injection_points import InjectionPoints

    polls: list[int] = []

    def is_committed(step: int) -> bool:
        polls.append(step)
        return len(polls) >= 3  # committed at the third look

    reporter = _Reporter()
    points = InjectionPoints([parse_injection("raise:rank=0:step=15:committed=10")], reporter, 0, 0, 0, is_committed)
    points.at_step_start(15)  # a raise fires inside the step body, not at its start
    assert polls == []
    with pytest.raises(InjectedFault):
        points.in_step_body(15)
    assert polls == [10, 10, 10]
    [(kind, step, details)] = reporter.events
    assert (kind, step, details["committed_found"]) == ("injection", 15, True)
    assert details["committed_wait"] > 0


def test_an_injection_without_committed_never_looks_at_storage():
    from undying.runtime.injection_points import InjectionPoints

    def is_committed(step: int) -> bool:
        raise AssertionError("looked at storage")

    reporter = _Reporter()
    points = InjectionPoints([parse_injection("raise:rank=0:step=15")], reporter, 0, 0, 0, is_committed)
    with pytest.raises(InjectedFault):
        points.in_step_body(15)
    assert reporter.events == [("injection", 15, {"spec": "raise:rank=0:step=15"})]


def test_a_node_fault_fires_once_every_local_rank_of_the_node_reached_its_step(tmp_path, monkeypatch):
    """``node:node=1:step=10`` takes the whole node at the start of step 10: its local rank 0 fires
    only after local rank 1 reached step 10 too (so it finished step 9 first), and not on node 0."""
    import threading

    from undying.runtime import injection_points
    from undying.runtime.injection_points import InjectionPoints

    fired: list[float] = []
    monkeypatch.setattr(injection_points, "fire", lambda injection: fired.append(time.monotonic()))
    injections = [parse_injection("node:node=1:step=10")]

    def points(node: int, local_rank: int) -> InjectionPoints:
        return InjectionPoints(injections, _Reporter(), node * 2 + local_rank, node, local_rank,
                               lambda step: True, tmp_path / "injections", local_world_size=2)

    points(0, 0).at_step_start(10)
    assert fired == []
    local_1 = points(1, 1)
    local_1.at_step_start(9)
    reached = []
    later = threading.Timer(0.3, lambda: (reached.append(time.monotonic()), local_1.at_step_start(10)))
    later.start()
    points(1, 0).at_step_start(10)
    later.join()
    assert len(fired) == 1 and fired[0] >= reached[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("slow:rank=3:step=8:factor=1.5", Injection(0, "slow", 8, rank=3, factor=1.5)),
        ("nan:rank=1:step=12", Injection(0, "nan", 12, rank=1)),
        ("nan:rank=1:step=12:persistent", Injection(0, "nan", 12, rank=1, persistent=True)),
        ("check:node=1", Injection(0, "check", None, node=1)),
        ("stall:rank=0:step=10:at=persist:seconds=3", Injection(0, "stall", 10, rank=0, at="persist", seconds=3.0)),
    ],
)
def test_parse_the_kinds_that_slow_poison_or_fail_a_check(text, expected):
    assert parse_injection(text) == expected
    assert parse_injection(expected.text()) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slow:rank=1:step=5", "slow needs factor=F with F > 1"),
        ("slow:rank=1:step=5:factor=1", "slow needs factor=F with F > 1"),
        ("check:node=1:step=3", "bad field 'step=3'"),
        ("nan:rank=1:step=2:persistent:persistent", "bad field 'persistent'"),
        ("stall:rank=1:step=2:seconds=soon", "seconds must be a number"),
        ("kill:rank=1:step=2:persistent", "bad field 'persistent'"),
    ],
)
def test_the_new_kinds_refuse_bad_fields_in_one_line(text, message):
    with pytest.raises(InjectionSpecError, match=message):
        parse_injection(text)


def test_a_check_injection_fires_in_no_worker_and_may_aim_at_a_spare():
    check = parse_injection("check:node=2")
    assert not check.targets(rank=0, node=2, local_rank=0, step=0)
    check_targets([check], world_size=4, nnodes=2)  # node 2: a spare's id


def test_in_step_points_fire_only_where_they_are_aimed():
    """An ``at=after_vote`` injection is claimed (its event sent) at the start of its step and fires
    at that point of it, on its rank, and nowhere else; ``aims_at`` tells the runtime which points'
    hooks to install in this worker."""
    from undying.runtime.injection_points import AFTER_VOTE, ALLREDUCE, OPTIMIZER, InjectionPoints

    reporter = _Reporter()
    aimed = [parse_injection("raise:rank=1:step=6:at=after_vote", 0),
             parse_injection("kill:rank=2:at=optimizer", 1)]
    points = InjectionPoints(aimed, reporter, 1, 0, 1, lambda step: True)
    assert points.aims_at(AFTER_VOTE) and not points.aims_at(OPTIMIZER) and not points.aims_at(ALLREDUCE)
    points.at_step_start(5)
    points.at_point(AFTER_VOTE, 5)
    assert reporter.events == []
    points.at_step_start(6)
    assert reporter.events == [("injection", 6, {"spec": "raise:rank=1:step=6:at=after_vote"})]
    points.in_step_body(6)
    points.at_point(ALLREDUCE, 6)
    with pytest.raises(InjectedFault, match="at=after_vote"):
        points.at_point(AFTER_VOTE, 6)
    points.at_point(AFTER_VOTE, 6)  # once
    assert InjectionPoints(aimed, reporter, 2, 1, 0, lambda step: True).aims_at(OPTIMIZER)
