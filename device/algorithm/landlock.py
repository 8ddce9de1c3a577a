"""Kernel-enforced confinement of an algorithm's process with Landlock (Linux 5.13+, unprivileged): what the audit
hook of :mod:`device.algorithm.runner` refuses at the Python level, the kernel refuses for native code too (a C
extension, ``ctypes``), for the process and every process it starts.

:func:`confine` restricts the calling process, from then on and for good:

* file system: every kind of write (writing or truncating a file, creating, removing, renaming or linking anything)
  is allowed only beneath the given directories, and on ``/dev/null``; nothing of the agent's own data directory can
  be read (its private key, its certificates, the tokens it keeps, other tasks' files) but the algorithm's package,
  its datasets and its directory; everything else stays readable (the interpreter, the libraries, ``/proc``);
* network (ABI 4+): no TCP bind or connect at all: the algorithm talks to its agent over its pipes only;
* scope (ABI 6+): no signal to a process outside its own domain (the agent, other workers) and no connection to an
  abstract Unix socket outside it.

It applies to the calling thread and to the threads and processes it starts afterwards: the runner calls it before
the algorithm's package is imported, so that all of the algorithm's code runs restricted (threads that existed
before, such as a BLAS library's pool, run only that library's kernels). Where the kernel has no
Landlock (older kernels, non-Linux, or disabled) it returns ``None`` and the audit hook remains the only guard; the
site says which in the worker's log. Only the standard library (``ctypes``) is used: the three system calls have
the same numbers on every architecture Linux gives them.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable
from pathlib import Path

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# access rights of the file system (include/uapi/linux/landlock.h)
_EXECUTE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 2, 1 << 3
_FILE_READS = _EXECUTE | _READ_FILE  # the read rights that may be granted on a file
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE_CHAR, _MAKE_DIR, _MAKE_REG, _MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM = 1 << 6, 1 << 7, 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_FILE_ONLY = _WRITE_FILE | _TRUNCATE  # the rights that may be granted on a file (not a directory) that we handle
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def abi_version() -> int | None:
    """The kernel's Landlock ABI version, or None when it has none (or it is disabled)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "syscall"):
        return None
    version = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return int(version) if version > 0 else None


def confine(writable: Iterable[Path], hidden: Path | None = None, readable: Iterable[Path] = (), devices: Iterable[str] = ("/dev/null",)) -> int | None:
    """Confine this process as the module says; the ABI version used, or None when the kernel has no Landlock.
    ``hidden`` (the agent's data directory: its keys, its tokens, other tasks' files) cannot be read either, but for
    what lies in ``writable`` and ``readable`` (the package, the datasets): everything else stays readable. ``OSError``
    when the kernel has Landlock and refuses the rules (the caller must not run the algorithm unconfined)."""
    version = abi_version()
    if version is None:
        return None
    libc = _libc()
    assert libc is not None
    writes = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG | _MAKE_SOCK | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM
    if version >= 2:
        writes |= _REFER
    if version >= 3:
        writes |= _TRUNCATE
    hide = hidden is not None and Path(hidden).is_dir()
    reads = _EXECUTE | _READ_FILE | _READ_DIR if hide else 0
    handled = writes | reads
    attr = _RulesetAttr(handled, _NET_BIND_TCP | _NET_CONNECT_TCP if version >= 4 else 0, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if version >= 6 else 0)
    size = 24 if version >= 6 else 16 if version >= 4 else 8
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _error("landlock_create_ruleset")
    try:
        for directory in writable:
            _allow(libc, ruleset, str(directory), handled, os.O_PATH | os.O_DIRECTORY)
        for device in devices:
            if os.path.exists(device):
                _allow(libc, ruleset, device, handled & _FILE_ONLY, os.O_PATH)
        if hide:
            assert hidden is not None
            secret = Path(hidden).resolve()
            for path in [*_around(secret), *(p for p in map(Path, readable) if not _covers(p.resolve(), secret))]:
                try:
                    _allow(libc, ruleset, str(path), reads if path.is_dir() else reads & _FILE_READS, os.O_PATH)
                except OSError:  # gone meanwhile, or a kind of file no rule applies to: it stays unreadable
                    continue
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _error("prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise _error("landlock_restrict_self")
    finally:
        os.close(ruleset)
    return version


def _around(hidden: Path) -> list[Path]:
    """What stays readable when ``hidden`` must not be: at each level from ``/`` down to it, every entry but the one
    that leads to it (the entries there now: a sibling made later is not readable)."""
    out: list[Path] = []
    for parent, towards in zip([*reversed(hidden.parents)], [*reversed(hidden.parents)][1:] + [hidden], strict=True):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            entry = parent / name
            if entry == towards:
                continue
            if entry.is_symlink():  # a rule is on what a link leads to: never a way to the hidden directory
                entry = entry.resolve()
                if _covers(entry, hidden) or hidden in entry.parents:
                    continue
            out.append(entry)
    return out


def _covers(path: Path, hidden: Path) -> bool:
    """A rule on ``path`` would open ``hidden``: it is that directory or one above it."""
    return path == hidden or path in hidden.parents


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, access: int, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        rule = _PathBeneathAttr(access, fd)
        if libc.syscall(_SYS_ADD_RULE, ruleset, ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise _error(f"landlock_add_rule({path})")
    finally:
        os.close(fd)


def _error(call: str) -> OSError:
    code = ctypes.get_errno() or errno.EINVAL
    return OSError(code, f"{call}: {os.strerror(code)}")
