"""qsdp_jax._src.distributed.peers and qsdp_jax._src.distributed.agreement without a cluster: the start-up guard's messages, the
coordinator port check, the settings comparison; one process makes every check a no-op."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from qsdp_jax import distributed

from qsdp_jax._src.distributed import agreement
from qsdp_jax._src.distributed import peers


def _guard_message(capsys, address, process_id, n=2):
    exits = []
    done = threading.Event()

    def leave(code):
        exits.append(code)
        done.set()

    with peers.connect_guard(address, process_id, n, 0.2, _exit=leave):
        assert done.wait(10)
    return exits, capsys.readouterr().err


def test_connect_guard_says_what_is_wrong(capsys):
    with socket.create_server(("127.0.0.1", 0)) as server:
        listening = f"127.0.0.1:{server.getsockname()[1]}"
        exits, err = _guard_message(capsys, listening, 1)
        assert exits == [69]
        assert (
            f"process 1 of 2 did not connect to the coordinator {listening} within 0.2 s: the "
            "coordinator runs there but not all 2 processes joined it"
        ) in err, err
        exits, err = _guard_message(capsys, listening, 0, n=3)
        assert (
            f"process 0 of 3 (the coordinator, at {listening}) waited 0.2 s but not all 3 "
            "processes connected to it: check that processes 1..2 started"
        ) in err, err
        with pytest.raises(ValueError, match=r"port \d+ \(127.0.0.1:\d+\) is already in use"):
            peers.check_port_free(listening)
    exits, err = _guard_message(capsys, listening, 1)  # closed now: nothing listens
    assert "nothing accepts connections there" in err and "Exiting with status 69." in err, err
    peers.check_port_free(listening)  # free again


def test_connect_guard_is_quiet_when_the_block_finishes():
    exits = []
    with peers.connect_guard("127.0.0.1:1", 1, 2, 5.0, _exit=exits.append):
        pass
    assert exits == []


def test_settings_comparison_names_process_key_and_both_values():
    base = agreement.flatten({"lr": 3e-3, "qsdp": {"bits": 8}, "out": None, "path": __import__("pathlib").Path("/x")})
    assert base == {"lr": 3e-3, "qsdp.bits": 8, "out": None, "path": "/x"}
    other = dict(base, lr=1e-2)
    del other["out"]
    answer = agreement._compare({0: json.dumps(base), 1: json.dumps(base), 2: json.dumps(other)})
    assert answer["differences"] == [("lr", 2, 1e-2, 3e-3), ("out", 2, "<not set>", None)]


def test_one_process_checks_nothing():
    distributed.check_agreement({"lr": 1.0})
    assert distributed.agree_on_error(None) is None
    assert distributed.agree_on_error("bad") == "bad"
    assert distributed.from_process_0("x") == "x"
    with distributed.watch_peers(1.0) as monitor:
        assert monitor.n == 1
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        peers.PeerMonitor(0)


class _FakeKV:
    """The two calls of jax's key-value store the monitor uses."""

    def __init__(self):
        self.data, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000)
            return self.data[key]


def _pair(monkeypatch, timeout_s=5.0):
    """A process-0 monitor and a process-1 monitor in this process, over localhost; their exits
    are recorded (``.exits``), not taken."""
    from jax._src import distributed as jd

    kv = _FakeKV()
    ids = iter([(kv, 0, 2), (kv, 1, 2)])
    monkeypatch.setattr(agreement, "client_and_ids", lambda: next(ids))
    monkeypatch.setattr(jd.global_state, "coordinator_address", "127.0.0.1:1")
    monkeypatch.setattr(peers, "_GRACE_S", 0.2)
    pair = []
    for _ in range(2):
        exits = []
        m = peers.PeerMonitor(timeout_s, connect_timeout_s=5, _exit=exits.append)
        m.exits = exits
        pair.append(m.start())
        peers._SESSIONS["n"] -= 1  # one counter per process: here both share this one
    deadline = __import__("time").monotonic() + 10
    while not any(i["id"] == 1 for i in pair[0]._conns.values()):  # process 1's HELLO arrived
        assert __import__("time").monotonic() < deadline
        __import__("time").sleep(0.01)
    return pair


def _wait_exit(monitor, timeout_s=5.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not monitor.exits:
        assert time.monotonic() < deadline, "no exit"
        time.sleep(0.01)
    return monitor.exits


def test_monitor_finish_is_not_a_death(monkeypatch, capsys):
    hub, peer = _pair(monkeypatch)
    peer.finish()
    __import__("time").sleep(0.5)
    hub.finish()
    assert hub.exits == [] and peer.exits == [], capsys.readouterr().err


def test_monitor_a_peer_that_stops_with_an_error_ends_the_hub(monkeypatch, capsys):
    hub, peer = _pair(monkeypatch)
    peer.fail("CLIError: --checkpoint-dir x is not a directory")
    assert _wait_exit(hub) == [75]
    err = capsys.readouterr().err
    assert (
        "process 0 of 2 stops: process 1 of 2 stopped before the run finished (CLIError: "
        "--checkpoint-dir x is not a directory). Exiting with status 75"
    ) in err, err


def test_monitor_a_dead_peer_and_a_dead_hub(monkeypatch, capsys):
    hub, peer = _pair(monkeypatch)
    peer._stop.set()  # as if killed: its connection closes without a word
    peer._thread.join()
    for sock in list(peer._conns):
        sock.close()
    assert _wait_exit(hub) == [75]
    assert "process 1 of 2 died or was killed: its connection closed" in capsys.readouterr().err
    hub, peer = _pair(monkeypatch)
    hub.fail("RuntimeError: boom")  # process 0 stops with an error: the others are told
    assert _wait_exit(peer) == [75]
    err = capsys.readouterr().err
    assert (
        "process 1 of 2 stops: process 0 of 2 (the coordinator) stopped before the run finished (RuntimeError: boom)"
    ) in err, err
    peer._close(b"")


def test_monitor_a_silent_peer_counts_as_frozen(monkeypatch, capsys):
    hub, peer = _pair(monkeypatch, timeout_s=0.5)
    peer._stop.set()  # stops sending heartbeats, connection open (SIGSTOP)
    peer._thread.join()
    assert _wait_exit(hub) == [75]
    assert "process 1 of 2 sent no heartbeat for 0.5 s" in capsys.readouterr().err


def test_monitor_reports_a_lost_coordinator_when_this_process_fails_at_that_moment(monkeypatch, capsys):
    """Process 0 dies and this process's own call fails at the same instant (a key-value RPC):
    its exit path still finds the closed connection and names process 0 (JAX aborts next)."""
    hub, peer = _pair(monkeypatch)
    hub._stop.set()  # process 0 killed
    hub._wake[1].send(b"x")
    hub._thread.join()
    for sock in list(hub._conns):
        sock.close()
    peer.fail("JaxRuntimeError: UNAVAILABLE: Connection reset by peer")
    assert _wait_exit(peer) == [75]
    assert "process 0 of 2 (the coordinator) died or was killed" in capsys.readouterr().err


def test_monitor_waits_a_moment_for_the_death_behind_its_own_failure(monkeypatch, capsys):
    """This process's collective fails first and the dead peer's connection closes 0.2 s
    later: the failing process still names the peer (it waits up to peers._FAIL_WAIT_S)."""
    import time

    hub, peer = _pair(monkeypatch)
    peer._stop.set()  # process 1 killed; its sockets close a moment after process 0's error
    peer._wake[1].send(b"x")
    peer._thread.join()
    closer = threading.Timer(0.2, lambda: [s.close() for s in list(peer._conns)])
    closer.start()
    t0 = time.monotonic()
    hub.fail("JaxRuntimeError: gloo: Connection closed by peer")
    closer.join()
    assert _wait_exit(hub) == [75]
    assert time.monotonic() - t0 < peers._FAIL_WAIT_S + 1.0
    assert "process 0 of 2 stops: process 1 of 2 died or was killed" in capsys.readouterr().err


def test_a_failing_process_with_live_peers_waits_no_longer_than_the_bound(monkeypatch):
    import time

    hub, peer = _pair(monkeypatch)
    t0 = time.monotonic()
    hub.fail("RuntimeError: boom")  # the peer lives on: no exit, back within the wait
    assert time.monotonic() - t0 < peers._FAIL_WAIT_S + 0.5 and hub.exits == []
    assert _wait_exit(peer) == [75]
    peer._close(b"")


@pytest.mark.parametrize("accepted", [False, True], ids=["in-backlog", "hello-unread"])
@pytest.mark.parametrize("end", ["finish", "fail"])
def test_the_hub_ends_for_a_peer_it_has_not_yet_heard_from(monkeypatch, capsys, end, accepted):
    """Process 0 stops (both processes found the same settings error) before its watching
    thread accepted process 1's connection, or before it read process 1's HELLO: its BYE (or
    GONE) still reaches process 1, which must not take the closed connection for a death (the
    CI flake of codes [-6, 75]: process 1 exited 75, and JAX aborted process 0 at shutdown)."""
    import time

    from jax._src import distributed as jd

    kv = _FakeKV()
    ids = iter([(kv, 0, 2), (kv, 1, 2)])
    monkeypatch.setattr(agreement, "client_and_ids", lambda: next(ids))
    monkeypatch.setattr(jd.global_state, "coordinator_address", "127.0.0.1:1")
    monkeypatch.setattr(peers, "_GRACE_S", 0.2)
    hub = peers.PeerMonitor(5.0, connect_timeout_s=5, _exit=[].append)

    def starved():  # the watching thread never gets to the connection (or past accepting it)
        while accepted and not hub._stop.is_set() and len(hub._conns) < 1:
            for key, _ in hub._sel.select(timeout=0.05):
                if key.data == "listen":
                    hub._add(key.fileobj.accept()[0], None)
        hub._stop.wait()

    hub._run = starved
    hub.start()
    peers._SESSIONS["n"] -= 1
    exits = []
    peer = peers.PeerMonitor(5.0, connect_timeout_s=5, _exit=exits.append).start()
    peers._SESSIONS["n"] -= 1
    deadline = time.monotonic() + 5
    while accepted and not hub._conns:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert all(info["id"] is None for info in hub._conns.values())
    if end == "finish":
        hub.finish()
    else:
        hub.fail("CLIError: the processes of this run were started with different trainer settings")
    time.sleep(0.2 + 0.5)  # the peer's grace for a GONE, and then some
    err = capsys.readouterr().err
    assert "died or was killed" not in err, err
    if end == "finish":
        assert exits == [], err
        peer.finish()
    else:
        assert exits == [75] and "process 0 of 2 (the coordinator) stopped before the run finished (CLIError" in err, (
            err
        )
        peer._close(b"")
