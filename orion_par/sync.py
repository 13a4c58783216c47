"""Token hand-over between compiled workers, without the GIL: acquire/release counters in an int64 array.

The executor's rule (``schedule``): a task may start once the previous use of its token has finished.
Worker threads keep a count per token of the uses finished so far; the holder of a token is its only
writer, so publishing is a plain store.  Inside numba code the count is read with an *acquire* load and
written with a *release* store, so the rows the previous holder wrote are visible before its count is,
and the compiler neither hoists the waiting load out of its loop nor sinks the block's writes below the
store.  A waiting worker spins (with ``pause`` on x86) for at most ``spin`` cycles of the CPU's time-stamp
counter, then returns to Python, which sleeps until the count arrives: a worker whose partner was
descheduled by another process gives its core back instead of burning it.

These functions are injected into the generated module of every body (``codegen``), which calls them from
``_orion_drive``.

Examples
--------
>>> import numpy as np
>>> done = np.zeros(2, np.int64)
>>> post(done, 1, 3)
>>> int(done[1]), bool(wait(done, 1, 3, 0, np.zeros(1, np.int64))), bool(wait(done, 0, 1, 0, np.zeros(1, np.int64)))
(3, True, False)
"""

from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

VERSION = 1  # in the generated driver's text: a change here must not reuse a stale numba cache
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _slot(context, builder, aryty, ary, index, indexty):  # type: ignore[no-untyped-def]
    arr = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, arr, [context.cast(builder, index, indexty, types.intp)])


def _int64_vector(counts: types.Type) -> bool:
    return isinstance(counts, types.Array) and counts.ndim == 1 and counts.dtype == types.int64


@intrinsic
def load_acquire(typingctx, counts, index):  # type: ignore[no-untyped-def]
    """``counts[index]``, read with acquire ordering (later reads cannot move before it)."""
    if not (_int64_vector(counts) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.load_atomic(_slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), "acquire", 8)

    return types.int64(counts, index), codegen


@intrinsic
def store_release(typingctx, counts, index, value):  # type: ignore[no-untyped-def]
    """``counts[index] = value`` with release ordering (earlier writes are visible before it)."""
    if not (_int64_vector(counts) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), ptr, "release", 8)
        return context.get_dummy_value()

    return types.none(counts, index, value), codegen


@intrinsic
def cycles(typingctx):  # type: ignore[no-untyped-def]
    """The CPU's cycle counter (``rdtsc`` on x86): cheap, monotonic enough to bound a spin."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def pause(typingctx):  # type: ignore[no-untyped-def]
    """A spin-loop hint (x86 ``pause``; nothing elsewhere)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@numba.njit(nogil=True, cache=True)
def wait(done, token, need, spin, waited):  # type: ignore[no-untyped-def]
    """Whether ``done[token]`` reached ``need`` within ``spin`` cycles; adds the cycles spent to ``waited[0]``."""
    if load_acquire(done, token) >= need:
        return True
    t0 = cycles()
    while True:
        for _ in range(64):
            pause()
        if load_acquire(done, token) >= need:
            waited[0] += cycles() - t0
            return True
        if cycles() - t0 > spin:
            waited[0] += cycles() - t0
            return False


@numba.njit(nogil=True, cache=True)
def post(done, token, value):  # type: ignore[no-untyped-def]
    """Publish ``done[token] = value`` after everything this thread wrote before."""
    store_release(done, token, value)


@numba.njit(nogil=True, cache=True)
def now():  # type: ignore[no-untyped-def]
    """``cycles()`` for the generated driver (a jitted function, so the generated module stays cacheable)."""
    return cycles()
