"""How long the user has been idle, from whichever source works on this host (detected once, at start).

Host sources: X11's screensaver extension (ctypes, no extra package), logind's IdleHint (`loginctl`), macOS
`HIDIdleTime` (`ioreg`), Windows `GetLastInputInfo` (ctypes). The proxy's last request (`ActivityTracker`)
always works: on a headless box the agent's own requests are the only sign of a user.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timezone

log = logging.getLogger(__name__)


class ActivityTracker:
    """Seconds since the last request to the proxy (or since start, before the first one)."""

    name = "proxy"

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self._lock = threading.Lock()
        self.last = self.clock()

    def touch(self) -> None:
        now = self.clock()
        with self._lock:
            self.last = now

    def idle_seconds(self, now: datetime) -> float:
        with self._lock:
            return max(0.0, (now - self.last).total_seconds())


class X11Idle:
    """`XScreenSaverQueryInfo(...).idle` through ctypes (libX11 + libXss), on the display in `$DISPLAY`."""

    name = "x11"

    class _Info(ctypes.Structure):
        _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                    ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong),
                    ("eventMask", ctypes.c_ulong)]  # fmt: skip

    def __init__(self) -> None:
        if not os.environ.get("DISPLAY"):
            raise OSError("DISPLAY is not set")
        x11, xss = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
        if not x11 or not xss:
            raise OSError("libX11 / libXss not found")
        self._x11, self._xss = ctypes.cdll.LoadLibrary(x11), ctypes.cdll.LoadLibrary(xss)
        self._x11.XOpenDisplay.restype = ctypes.c_void_p
        self._x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self._x11.XDefaultRootWindow.restype = ctypes.c_ulong
        self._xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(self._Info)
        self._xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(self._Info)]
        self._display = self._x11.XOpenDisplay(None)
        if not self._display:
            raise OSError(f"cannot open X display {os.environ['DISPLAY']!r}")
        self._info = self._xss.XScreenSaverAllocInfo()
        self.idle_seconds(datetime.now(timezone.utc))

    def idle_seconds(self, now: datetime) -> float:
        root = self._x11.XDefaultRootWindow(self._display)
        if not self._xss.XScreenSaverQueryInfo(self._display, root, self._info):
            raise OSError("XScreenSaverQueryInfo failed (no MIT-SCREEN-SAVER extension?)")
        return self._info.contents.idle / 1000.0


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout


class LogindIdle:
    """logind's `IdleHint` / `IdleSinceHint` of this session (`$XDG_SESSION_ID`), via `loginctl show-session`."""

    name = "logind"

    def __init__(self) -> None:
        self.session = os.environ.get("XDG_SESSION_ID")
        if not self.session or not shutil.which("loginctl"):
            raise OSError("no logind session (XDG_SESSION_ID unset or loginctl missing)")
        self.idle_seconds(datetime.now(timezone.utc))

    def idle_seconds(self, now: datetime) -> float:
        out = _run(["loginctl", "show-session", self.session, "-p", "IdleHint", "-p", "IdleSinceHint"])
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if "IdleHint" not in props:
            raise OSError(f"loginctl gave no IdleHint for session {self.session}")
        if props["IdleHint"] != "yes":
            return 0.0
        since_us = int(props.get("IdleSinceHint") or 0)
        return max(0.0, now.timestamp() - since_us / 1e6) if since_us else 0.0


class MacIdle:
    """`HIDIdleTime` (nanoseconds) from `ioreg -c IOHIDSystem`."""

    name = "macos"

    def __init__(self) -> None:
        if sys.platform != "darwin" or not shutil.which("ioreg"):
            raise OSError("not macOS")
        self.idle_seconds(datetime.now(timezone.utc))

    def idle_seconds(self, now: datetime) -> float:
        match = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', _run(["ioreg", "-c", "IOHIDSystem"]))
        if not match:
            raise OSError("ioreg shows no HIDIdleTime")
        return int(match.group(1)) / 1e9


class WindowsIdle:
    """`GetTickCount64() - GetLastInputInfo().dwTime` through ctypes."""

    name = "windows"

    class _LastInput(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    def __init__(self) -> None:
        if sys.platform != "win32":
            raise OSError("not Windows")
        self._user32, self._kernel32 = ctypes.windll.user32, ctypes.windll.kernel32  # type: ignore[attr-defined]
        self._kernel32.GetTickCount64.restype = ctypes.c_ulonglong
        self.idle_seconds(datetime.now(timezone.utc))

    def idle_seconds(self, now: datetime) -> float:
        info = self._LastInput(cbSize=ctypes.sizeof(self._LastInput))
        if not self._user32.GetLastInputInfo(ctypes.byref(info)):
            raise OSError("GetLastInputInfo failed")
        return ((self._kernel32.GetTickCount64() & 0xFFFFFFFF) - info.dwTime) % 2**32 / 1000.0


HOST_SOURCES: dict[str, type] = {"x11": X11Idle, "logind": LogindIdle, "macos": MacIdle, "windows": WindowsIdle}


class CombinedIdle:
    """The user is idle as long as neither the host nor the proxy saw activity: the smaller idle time wins.

    A host source that starts failing is reported once and left out from then on (the proxy still counts).
    """

    def __init__(self, host: object | None, proxy: ActivityTracker | None) -> None:
        if host is None and proxy is None:
            raise ValueError("no idle source")
        self.host, self.proxy = host, proxy
        self.name = "+".join(s.name for s in (host, proxy) if s is not None)

    def idle_seconds(self, now: datetime) -> float:
        values = []
        if self.host is not None:
            try:
                values.append(self.host.idle_seconds(now))
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                log.error("Idle source %s failed (%s): using the proxy's last request only", self.host.name, e)
                self.host = None
                self.name = "proxy"
        if self.proxy is not None:
            values.append(self.proxy.idle_seconds(now))
        return min(values) if values else 0.0


def detect_host_idle(kind: str = "auto") -> object | None:
    """The first host idle source that works (`kind="auto"`), the named one, or None for `kind="proxy"`.

    Raises:
        ValueError: a named source that does not work on this host, or an unknown name.
    """
    if kind == "proxy":
        return None
    if kind != "auto":
        if kind not in HOST_SOURCES:
            known = ["auto", "proxy", *HOST_SOURCES]
            raise ValueError(f"scheduler.idle_source must be one of {known}, got {kind!r}")
        try:
            return HOST_SOURCES[kind]()
        except (OSError, ValueError, AttributeError, subprocess.SubprocessError) as e:
            raise ValueError(f"scheduler.idle_source={kind} does not work on this host: {e}") from e
    for name, cls in HOST_SOURCES.items():
        try:
            source = cls()
        except (OSError, ValueError, AttributeError, subprocess.SubprocessError) as e:
            log.debug("Idle source %s unavailable: %s", name, e)
            continue
        log.info("Idle source: %s (and the proxy's last request)", name)
        return source
    log.info("Idle source: the proxy's last request (no X11, logind, macOS or Windows idle time on this host)")
    return None
