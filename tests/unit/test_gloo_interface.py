"""The interface a gloo worker is pointed at: the one holding this host's address towards the job's
store, never over a user's own choice, never for loopback or nccl, and one stderr line when it
cannot be found (runtime/gloo_interface.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from undying.runtime.gloo_interface import GLOO_SOCKET_IFNAME, choose_gloo_interface

STORE_PORT = 29500  # never contacted: a UDP connect only picks a route


def a_real_interface() -> tuple[str, str]:
    """(name, IPv4 address) of an interface of this machine, as iproute2 reports it (the first
    address listed for an interface is its primary one)."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to list this machine's addresses")
    listed = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                            text=True, timeout=30).stdout
    addresses: dict[str, str] = {}
    for line in listed.splitlines():
        fields = line.split()  # "2: eth0    inet 10.0.0.5/24 brd ..."
        if len(fields) > 3:
            addresses.setdefault(fields[1], fields[3].split("/")[0])
    if not addresses:
        pytest.skip("this machine has no interface with a global IPv4 address")
    name = "eth0" if "eth0" in addresses else next(iter(addresses))
    return name, addresses[name]


def test_a_store_reached_through_an_interface_points_gloo_at_it(capsys: pytest.CaptureFixture[str]) -> None:
    name, address = a_real_interface()
    environ: dict[str, str] = {}
    assert choose_gloo_interface("gloo", (address, STORE_PORT), environ) == name
    assert environ == {GLOO_SOCKET_IFNAME: name}
    assert capsys.readouterr().err == ""


def test_a_store_on_loopback_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    for host in ("127.0.0.1", "localhost"):
        environ: dict[str, str] = {}
        assert choose_gloo_interface("gloo", (host, STORE_PORT), environ) is None
        assert environ == {}
    assert capsys.readouterr().err == ""


def test_the_users_own_variable_wins() -> None:
    _, address = a_real_interface()
    environ = {GLOO_SOCKET_IFNAME: "ib0"}
    assert choose_gloo_interface("gloo", (address, STORE_PORT), environ) is None
    assert environ == {GLOO_SOCKET_IFNAME: "ib0"}


def test_nccl_and_a_standalone_run_change_nothing() -> None:
    _, address = a_real_interface()
    environ: dict[str, str] = {}
    assert choose_gloo_interface("nccl", (address, STORE_PORT), environ) is None
    assert choose_gloo_interface("gloo", None, environ) is None
    assert environ == {}


def test_a_store_that_cannot_be_placed_changes_nothing_and_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    environ: dict[str, str] = {}
    assert choose_gloo_interface("gloo", ("no-such-store.invalid", STORE_PORT), environ) is None
    assert environ == {}
    [line] = capsys.readouterr().err.splitlines()
    assert "no-such-store.invalid" in line and GLOO_SOCKET_IFNAME in line
