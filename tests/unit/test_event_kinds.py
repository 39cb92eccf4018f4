"""The event log's vocabulary: every kind is an EventKind member documented in docs/events.md, every
kind the sources name is a member, and a log with kinds this version does not know still reads."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from undying import events
from undying.events import Event, EventKind, read_events

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "src" / "undying"
DOC = ROOT / "docs" / "events.md"
# Upper-case names of events.py that are not event kinds.
NOT_KINDS = {"EVENTS_FILE"}


def documented_kinds() -> list[str]:
    return re.findall(r"^### `([a-z0-9_]+)`$", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)


def kind_names_in_sources() -> dict[str, list[str]]:
    """Every upper-case name the package takes from undying.events (``ev.NAME`` after ``from undying
    import events as ev``, or ``from undying.events import NAME``) -> where."""
    found: dict[str, list[str]] = {}
    for path in sorted(SOURCES.rglob("*.py")):
        if path.name == "events.py" and path.parent == SOURCES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module == "undying" for alias in node.names if alias.name == "events"}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and node.module == "undying.events":
                names = [alias.name for alias in node.names]
            for name in names:
                if name.isupper() and name not in NOT_KINDS:
                    found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_kind_is_documented_once_and_the_doc_names_no_other():
    documented = documented_kinds()
    assert len(documented) == len(set(documented)), sorted({k for k in documented if documented.count(k) > 1})
    members = {kind.value for kind in EventKind}
    assert sorted(members - set(documented)) == [], "kinds missing from docs/events.md"
    assert sorted(set(documented) - members) == [], "docs/events.md describes kinds that are not EventKind members"


def test_every_kind_named_in_the_sources_is_a_member():
    used = kind_names_in_sources()
    assert len(used) > 40  # the parse found the call sites (a broken walk would find none and pass)
    not_members = {name: where for name, where in used.items()
                   if not isinstance(getattr(events, name, None), EventKind)}
    assert not_members == {}


def test_module_names_are_the_members():
    for kind in EventKind:
        assert getattr(events, kind.name) is kind
    upper = {name for name in vars(events) if name.isupper()} - NOT_KINDS
    assert upper == set(EventKind.__members__)


def test_values_are_the_public_format(tmp_path: Path):
    line = Event(kind=EventKind.HEARTBEAT, time=1.0, rank=2, details={"phase": "computing"}).to_json()
    assert json.loads(line)["kind"] == "heartbeat"
    assert '"kind": "heartbeat"' in line
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", kind.value) for kind in EventKind)


def test_a_log_with_unknown_kinds_still_reads(tmp_path: Path):
    log = tmp_path / events.EVENTS_FILE
    log.write_text("\n".join([
        json.dumps({"kind": "job_start", "time": 1.0, "details": {"world_size": 4}}),
        json.dumps({"kind": "from_a_newer_undying", "time": 2.0, "rank": 1, "details": {"x": 1}}),
        json.dumps({"kind": "job_end", "time": 3.0, "details": {"outcome": "succeeded"}}),
        '{"kind": "torn',
    ]) + "\n", encoding="utf-8")
    read = read_events(tmp_path)
    assert [event.kind for event in read] == ["job_start", "from_a_newer_undying", "job_end"]
    assert read[0].kind == EventKind.JOB_START and read[2].kind == events.JOB_END
    assert (read[1].rank, read[1].details) == (1, {"x": 1})
