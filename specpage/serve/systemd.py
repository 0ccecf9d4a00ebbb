"""sd_notify on the standard library: readiness, status, stopping and watchdog pings.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op that returns False,
so the daemon runs the same in a terminal, a container or a test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send newline-separated ``KEY=VALUE`` assignments to systemd; True if sent."""
    address = env.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]  # Linux abstract namespace
    elif not address.startswith("/"):
        return False  # unset, or a transport we do not speak (vsock:)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as error:
        # A lost ping must not take the daemon down; the watchdog will tell if it persists.
        log.warning("sd_notify to %r failed: %s", env["NOTIFY_SOCKET"], error)
        return False
    return True


def ready(env: Mapping[str, str] = os.environ) -> bool:
    return notify("READY=1", env)


def status(text: str, env: Mapping[str, str] = os.environ) -> bool:
    # A newline would start a new assignment, so a status could forge READY=1 or the like.
    return notify("STATUS=" + " ".join(text.splitlines()), env)


def stopping(env: Mapping[str, str] = os.environ) -> bool:
    return notify("STOPPING=1", env)


def watchdog_ping(env: Mapping[str, str] = os.environ) -> bool:
    return notify("WATCHDOG=1", env)


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between pings (half of WatchdogSec), or None when no watchdog is ours."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
        pid = int(env.get("WATCHDOG_PID", os.getpid()))
    except ValueError:
        return None
    if usec <= 0 or pid != os.getpid():
        return None  # a watchdog meant for a parent process, or none at all
    return usec / 2 / 1_000_000


async def watchdog_loop(interval: float, env: Mapping[str, str] = os.environ) -> None:
    """Ping every interval seconds until cancelled.

    It runs on the event loop on purpose: a loop blocked for longer than WatchdogSec
    stops the pings, and systemd restarts a daemon that no longer serves.
    """
    while True:
        watchdog_ping(env)
        await asyncio.sleep(interval)
