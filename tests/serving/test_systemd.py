"""sd_notify against real Unix datagram sockets, as systemd's notify socket is one."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from specpage.serve import systemd


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    path = tmp_path / "notify.sock"
    assert len(str(path)) < 108, "AF_UNIX paths are limited to 107 bytes"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield sock, {"NOTIFY_SOCKET": str(path)}


def received(sock: socket.socket, count: int) -> list[str]:
    return [sock.recv(4096).decode() for _ in range(count)]


def test_messages_arrive_in_order(path_socket: tuple[socket.socket, dict[str, str]]) -> None:
    sock, env = path_socket
    assert systemd.status("loading smollm2-135m", env)
    assert systemd.ready(env)
    assert systemd.watchdog_ping(env)
    assert systemd.stopping(env)
    assert systemd.notify("STATUS=a\nEXTEND_TIMEOUT_USEC=1000000", env)
    assert received(sock, 5) == [
        "STATUS=loading smollm2-135m",
        "READY=1",
        "WATCHDOG=1",
        "STOPPING=1",
        "STATUS=a\nEXTEND_TIMEOUT_USEC=1000000",
    ]


def test_status_cannot_inject_assignments(
    path_socket: tuple[socket.socket, dict[str, str]],
) -> None:
    sock, env = path_socket
    assert systemd.status("draining\nREADY=1", env)
    assert received(sock, 1) == ["STATUS=draining READY=1"]


@pytest.mark.skipif(sys.platform != "linux", reason="abstract sockets are Linux only")
def test_abstract_socket() -> None:
    name = f"specpage-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        env = {"NOTIFY_SOCKET": "@" + name}
        assert systemd.ready(env)
        assert systemd.status("serving", env)
        assert received(sock, 2) == ["READY=1", "STATUS=serving"]


def test_without_notify_socket_is_a_no_op() -> None:
    assert systemd.ready({}) is False
    assert systemd.notify("READY=1", {"NOTIFY_SOCKET": ""}) is False
    assert systemd.notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"}) is False


def test_unreachable_socket_returns_false(tmp_path: Path) -> None:
    assert systemd.ready({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")}) is False


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert systemd.watchdog_interval(env) == expected


@pytest.mark.asyncio
async def test_watchdog_loop_pings_until_cancelled(
    path_socket: tuple[socket.socket, dict[str, str]],
) -> None:
    sock, env = path_socket
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(systemd.watchdog_loop(0.01, env))
    try:
        for _ in range(3):
            message = await asyncio.wait_for(loop.sock_recv(sock, 4096), timeout=60)
            assert message == b"WATCHDOG=1"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert task.cancelled()
