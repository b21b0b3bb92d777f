"""Tests for experiments.shelf.netns (namespace tests skip unless root + iproute2 + netns work)."""

import math
import os
import signal
import subprocess
import time

import pytest

from experiments.shelf.netns import (
    Terminated,
    check_netns_support,
    cleanup_stale,
    list_namespaces,
    shaped_namespace,
)

PREFIX = "qsdptest"  # our own prefix: never touch namespaces of concurrent runs


@pytest.fixture(scope="module")
def netns_ok():
    reason = check_netns_support()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")


def ns_exists(name):
    return name in list_namespaces(prefix=None)


def test_check_support_returns_none_or_reason():
    r = check_netns_support()
    assert r is None or (isinstance(r, str) and r)


def test_namespace_exists_inside_and_removed_after(netns_ok):
    with shaped_namespace(name_prefix=PREFIX) as ns:
        assert ns.name.startswith(f"{PREFIX}-{os.getpid()}-")
        assert ns_exists(ns.name) and ns.exists()
        assert ns.prefix() == ["ip", "netns", "exec", ns.name]
        assert ns.wrap(["true"]) == ["ip", "netns", "exec", ns.name, "true"]
        link = ns.run(["ip", "link", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout
        assert "mtu 9000" in link and "UP" in link
        # unshaped: no tbf
        assert "tbf" not in ns.qdisc_show()
        # only lo exists in the namespace: nothing can leave it
        links = ns.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert [l.split(":")[1].strip() for l in links.splitlines()] == ["lo"]
    assert not ns_exists(ns.name)


def test_two_namespaces_are_unique(netns_ok):
    with shaped_namespace(name_prefix=PREFIX) as a, shaped_namespace(name_prefix=PREFIX) as b:
        assert a.name != b.name
        assert ns_exists(a.name) and ns_exists(b.name)
    assert not ns_exists(a.name) and not ns_exists(b.name)


def test_tc_shaping_applied(netns_ok):
    with shaped_namespace(name_prefix=PREFIX, rate_mbit=200, burst_kb=512, latency_ms=80) as ns:
        q = ns.qdisc_show()
        assert "tbf" in q
        assert "rate 200Mbit" in q
        assert "burst 512Kb" in q
        # qdisc is on the namespace's lo, not on the host's
        host = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "200Mbit" not in host
    assert not ns_exists(ns.name)


def test_fractional_rate(netns_ok):
    with shaped_namespace(name_prefix=PREFIX, rate_mbit=2.5) as ns:
        assert "rate 2500Kbit" in ns.qdisc_show()


def test_removed_when_body_raises(netns_ok):
    with pytest.raises(ZeroDivisionError):
        with shaped_namespace(name_prefix=PREFIX, rate_mbit=100) as ns:
            name = ns.name
            assert ns_exists(name)
            1 / 0
    assert not ns_exists(name)


def test_removed_on_keyboard_interrupt(netns_ok):
    with pytest.raises(KeyboardInterrupt):
        with shaped_namespace(name_prefix=PREFIX) as ns:
            name = ns.name
            raise KeyboardInterrupt
    assert not ns_exists(name)


def test_removed_on_sigterm_and_handler_restored(netns_ok):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as ei:
        with shaped_namespace(name_prefix=PREFIX) as ns:
            name = ns.name
            assert signal.getsignal(signal.SIGTERM) is not before
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, at the latest
            pytest.fail("SIGTERM did not raise")
    assert ei.value.code == 128 + signal.SIGTERM
    assert not ns_exists(name)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rate_mbit=0),
        dict(rate_mbit=-5),
        dict(rate_mbit=math.nan),
        dict(rate_mbit=math.inf),
        dict(rate_mbit="100"),
        dict(rate_mbit=100, burst_kb=128),
        dict(rate_mbit=100, burst_kb=255.9),
        dict(mtu=10),
        dict(mtu=9000.0),
        dict(latency_ms=0),
        dict(name_prefix="bad-prefix"),
        dict(name_prefix="x" * 40),
        dict(name_prefix=""),
    ],
)
def test_argument_validation(kwargs):
    with pytest.raises((ValueError, TypeError)):
        with shaped_namespace(**kwargs):
            pytest.fail("should not get here")


def test_cleanup_stale_only_dead_owners(netns_ok):
    prefix = f"qsdpcl{os.getpid()}"  # private to this test: cleanup below must not hit others
    dead = f"{prefix}-999999999-dead"  # pid > pid_max: owner surely dead
    live = f"{prefix}-{os.getpid()}-beef"
    try:
        for n in (dead, live):
            subprocess.run(["ip", "netns", "add", n], check=True)
        assert set(list_namespaces(prefix)) == {dead, live}
        removed = cleanup_stale(prefix)
        assert dead in removed and live not in removed
        assert not ns_exists(dead) and ns_exists(live)
        removed = cleanup_stale(prefix, only_dead_owners=False)
        assert live in removed and not ns_exists(live)
    finally:
        for n in (dead, live):
            subprocess.run(["ip", "netns", "delete", n], capture_output=True)


def test_support_reasons(monkeypatch):
    import experiments.shelf.netns as netns

    monkeypatch.setattr(netns, "_support_cache", {})  # fake answers must not stay cached
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    r = netns.check_netns_support(use_cache=False)
    assert r is not None and "root" in r
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
    r = netns.check_netns_support(use_cache=False)
    assert r is not None and "'tc'" in r
