"""The network of the test bed: namespaces, veths on a bridge, and tc limits.

Names, locks and subnets of a test bed (:class:`~ray_rdt_pool.bench.testbed.TestBed`),
the commands that build its namespaces, and :func:`probe_namespaces`, which says whether
they can be built here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import re
import secrets
import shlex
import shutil
import string
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


#: Every name the test bed gives an interface or a namespace starts with this.
PREFIX = "rtb"
#: Where its lock files, Ray temp dirs, scripts and command logs live.
BASE_DIR = Path("/tmp/rtb")
#: The node's end of its veth, inside its namespace (the same name in every namespace).
INNER_DEV = "eth0"


#: The candidate subnets: 198.18.0.0/15 is reserved for network benchmarks (RFC 2544).
SUBNET_POOL = ipaddress.IPv4Network("198.18.0.0/15")
#: Linux limits interface names to 15 characters; "rtb" + tag + "v" + 3 digits fits.
MAX_NODES = 200
TAG_LEN = 4
_TAG_CHARS = string.ascii_lowercase + string.digits
#: Namespaces: nodes ("n<i>"), the switch ("s"), the probe ("p"); host links of that form
#: are never made, but would be removed too.
NAME_RE = re.compile(rf"^{PREFIX}([a-z0-9]{{{TAG_LEN}}})(?:n\d+|s|p|v\d+|b)$")
#: The bridge in the switch namespace (which also holds the veths' switch ends, "v<i>").
BRIDGE = "br0"
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_SIZE_RE = re.compile(r"^(\d+)(b|kb|mb|k|m|kbit|mbit)?$")
_SIZE_UNITS = {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 1 << 20, "mb": 1 << 20,
               "kbit": 128, "mbit": 131072}


class TestBedError(RuntimeError):
    """The test bed could not be built, a command in it failed, or cleanup left something."""

    __test__ = False  # not a pytest test class


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``"500mbit"`` (``mbps`` means megabytes)."""
    m = _RATE_RE.match(rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r} is not a tc rate: give e.g. '500mbit' or '1gbit'")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_size(size: str) -> int:
    """Bytes of a ``tc`` size such as ``"512kb"`` (``kb`` = 1024 bytes, as tc reads it)."""
    m = _SIZE_RE.match(size.strip().lower())
    if m is None:
        raise ValueError(f"size {size!r} is not a tc size: give e.g. '512kb' or '1mb'")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def ns_name(tag: str, i: int) -> str:
    return f"{PREFIX}{tag}n{i}"


def switch_name(tag: str) -> str:
    return f"{PREFIX}{tag}s"


def _probe_name(tag: str) -> str:
    return f"{PREFIX}{tag}p"


def own_netns(name: str, tag: str) -> bool:
    m = NAME_RE.match(name)
    return m is not None and m.group(1) == tag


def netns_lock(tag: str, create: bool) -> int | None:
    """Open and flock the tag's lock file; None when another live process holds it (or,
    with ``create``, when the tag is taken)."""
    path = BASE_DIR / f"{tag}.lock"
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def new_tag() -> tuple[str, int]:
    BASE_DIR.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        tag = "".join(secrets.choice(_TAG_CHARS) for _ in range(TAG_LEN))
        if (BASE_DIR / tag).exists():
            continue  # the kept logs of an earlier run
        fd = netns_lock(tag, create=True)
        if fd is not None:
            return tag, fd
    raise TestBedError(f"no free test-bed tag in {BASE_DIR} after 100 tries")


def sh(argv: Sequence[str], check: bool = True, timeout: float = 30.0,
        log: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = shlex.join(argv)
    logger.debug("testbed: %s", cmd)
    if log is not None:
        log.append(f"{time.strftime('%H:%M:%S')} {cmd}")
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                       check=False)
    if check and r.returncode != 0:
        raise TestBedError(f"`{cmd}` failed with exit status {r.returncode}: "
                           f"{(r.stderr or r.stdout).strip()[-2000:]}")
    return r


def netns_list() -> list[str]:
    r = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def link_names() -> list[str]:
    r = sh(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table",
                                                     "all"]):
        out = sh(argv, check=False).stdout
        for tok in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", out):
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(tok, strict=False))
    return nets


def pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = [ipaddress.IPv4Network(n) for n in SUBNET_POOL.subnets(new_prefix=24)]
    secrets.SystemRandom().shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise TestBedError(f"every /24 of {SUBNET_POOL} overlaps a host address or route")


def probe_namespaces() -> str | None:
    """None when network namespaces, veths and tc work here, else the reason they do not."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces, veths and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2)"
    try:
        tag, fd = new_tag()
    except OSError as e:
        return f"cannot write its lock file in {BASE_DIR}: {e}"
    ns = _probe_name(tag)
    try:
        # Everything is made inside a throwaway namespace: the host's links are untouched.
        steps = [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "add", "b0", "type", "bridge"],
                 ["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                 ["ip", "-n", ns, "link", "set", "v0", "master", "b0"],
                 ["ip", "-n", ns, "link", "set", "v0", "up"],
                 ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "v0", "root",
                  "tbf", "rate", "100mbit", "burst", "64kb", "latency", "50ms"]]
        for argv in steps:
            r = sh(argv, check=False)
            if r.returncode != 0:
                return (f"`{shlex.join(argv)}` failed here: "
                        f"{(r.stderr or r.stdout).strip()[-300:]}")
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"network namespaces do not work here: {e}"
    finally:
        if ns in netns_list():
            sh(["ip", "netns", "del", ns], check=False)
        with contextlib.suppress(FileNotFoundError):
            (BASE_DIR / f"{tag}.lock").unlink()
        os.close(fd)
