"""The C library calls the package makes through ctypes, each declared once with its types.

ctypes releases the GIL for the length of each call, which is what lets the read threads
overlap their system calls and copies.  No torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

__all__ = ["LIBC", "MAP_FAILED", "SYS_CACHESTAT", "fallocate", "preadv2"]

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
]
LIBC.mmap.restype = ctypes.c_void_p
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.munmap.restype = ctypes.c_int
LIBC.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
LIBC.memcpy.restype = ctypes.c_void_p
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
LIBC.mincore.restype = ctypes.c_int
LIBC.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
LIBC.preadv.restype = ctypes.c_ssize_t
LIBC.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
LIBC.fstatfs.restype = ctypes.c_int
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.madvise.restype = ctypes.c_int

#: ``preadv2`` (flags such as ``RWF_NOWAIT``), or ``None`` on a C library without it.
preadv2: Any = getattr(LIBC, "preadv2", None)
if preadv2 is not None:
    preadv2.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    preadv2.restype = ctypes.c_ssize_t

#: ``fallocate`` (Linux), or ``None`` on a C library without it.
fallocate: Any = getattr(LIBC, "fallocate", None)
if fallocate is not None:
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int

#: The ``cachestat`` system call's number (Linux 6.5 and later, the same on every
#: architecture: it came after their tables were unified); called through ``syscall``.
SYS_CACHESTAT = 451
LIBC.syscall.restype = ctypes.c_long

#: What ``mmap`` returns on failure, as ctypes gives a ``c_void_p`` result.
MAP_FAILED = ctypes.c_void_p(-1).value
