"""Message fields with a fixed vocabulary are their enum once decoded, travel as the same JSON as
plain strings did, and a value outside the vocabulary is refused with one line naming the message,
the field and the values allowed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from undying.protocol import (
    Heartbeat,
    Message,
    Order,
    OrderKind,
    Phase,
    Plan,
    PlanAction,
    WorkerState,
    WorkerStatus,
    hello_order,
)
from undying.strategy_names import StrategyName

# Each message with an enum field, its JSON as a peer sends it, and the field's enum.
WIRE: list[tuple[type[Message], dict[str, Any], str, type]] = [
    (Heartbeat, {"rank": 1, "node": 0, "generation": 2, "step": 7, "phase": "syncing", "pid": 42}, "phase", Phase),
    (WorkerStatus, {"rank": 3, "local_rank": 1, "pid": 9, "generation": 1, "state": "exited", "exitcode": -9,
                    "signal": "SIGKILL"}, "state", WorkerState),
    (Order, {"kind": "replace", "generation": 3, "ranks": [2, 3], "world_size": 4}, "kind", OrderKind),
    (Plan, {"action": "resume", "strategy": "recover-in-place", "generation": 2, "world_size": 4,
            "target_step": 8, "receivers_runs": [[3, 4]]}, "action", PlanAction),
    (Plan, {"action": "dump", "strategy": "dump", "generation": 2}, "strategy", StrategyName),
]


@pytest.mark.parametrize(("cls", "data", "name", "enum"), WIRE, ids=lambda x: getattr(x, "__name__", None))
def test_decoded_as_members_and_encoded_as_before(cls: type[Message], data: dict[str, Any], name: str, enum: type):
    message = cls.from_dict(data)
    value = getattr(message, name)
    assert type(value) is enum and value == data[name]
    encoded = message.to_dict()
    assert json.loads(json.dumps(encoded))[name] == data[name]
    assert {key: encoded[key] for key in data} == data  # the wire as it came (what the peer sent)
    # The same message built from plain strings (how an older sender held it) encodes to the same bytes.
    plain = cls.from_dict(data)
    object.__setattr__(plain, name, str(value))
    assert json.dumps(plain.to_dict(), sort_keys=True) == json.dumps(encoded, sort_keys=True)


@pytest.mark.parametrize(("cls", "data", "name", "enum"), WIRE, ids=lambda x: getattr(x, "__name__", None))
@pytest.mark.parametrize("bad", ["bogus", "", "RESUME", 3, None, ["start"]])
def test_a_value_outside_the_enum_is_refused_naming_the_field(cls: type[Message], data: dict[str, Any], name: str,
                                                              enum: type, bad: Any):
    if bad == "" and enum is StrategyName:
        return  # a plan's empty strategy: none (a wait, an exit)
    with pytest.raises(ValueError) as refused:
        cls.from_dict({**data, name: bad})
    text = str(refused.value)
    assert text.startswith(f"{cls.__name__}.{name}: expected one of ")
    assert all(member.value in text for member in enum)


def test_a_plan_without_a_strategy():
    wait = Plan.from_dict({"action": "wait"})
    assert (wait.action, wait.strategy) == (PlanAction.WAIT, "")
    assert json.loads(json.dumps(wait.to_dict()))["strategy"] == ""


def test_defaults_encode_as_strings():
    assert json.loads(json.dumps(Order().to_dict()))["kind"] == "none"
    assert json.loads(json.dumps(Plan().to_dict()))["action"] == "wait"


def test_say_hello_is_its_own_field_on_the_wire():
    wire = json.loads(json.dumps(hello_order().to_dict()))
    assert (wire["kind"], wire["say_hello"]) == ("none", True)
    assert Order.from_dict(wire).say_hello
    # A reason is words for people: an order whose reason reads "hello" tells the agent nothing.
    assert not Order.from_dict({"kind": "stop", "reason": "hello"}).say_hello
    assert json.loads(json.dumps(Order().to_dict()))["say_hello"] is False


def test_an_agent_that_holds_no_place_is_told_to_say_hello(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    assert job.poll(0).say_hello  # no node said hello yet
    orders = job.start_running()
    assert not any(order.say_hello for order in orders)
    assert not job.poll(1, 1, job.statuses(1, 1)).say_hello
    job.controller.report_agent_exit(1, -9)
    assert job.poll(1).say_hello  # its place is lost: its agent must stop its workers and say hello
