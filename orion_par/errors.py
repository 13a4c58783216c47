"""Exceptions and warnings that orion_par raises on purpose.

Every message says what went wrong, where (the body's file and line), and how to fix it.
"""

from __future__ import annotations


class OrionParError(Exception):
    """Base class of every error orion_par raises on purpose."""


class BadBodyError(OrionParError, ValueError):
    """The decorated function or its data cannot be used (wrong signature, no source, bad keys)."""


class NotParallelizableError(OrionParError):
    """No parallel plan keeps the result of a serial execution.

    ``conflicts`` holds the dependences that decided it (each names two accesses and their lines);
    ``fixes`` the codes of the fixes the message offers (``explain.FIXES``).
    """

    def __init__(self, message: str, conflicts: tuple[object, ...] = (), fixes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.conflicts = conflicts
        self.fixes = fixes


class DataOrderError(OrionParError, ValueError):
    """An ordered loop's data is not in the order its wavefront plan needs."""


class CompileFallbackWarning(UserWarning):
    """numba could not compile a loop body; it runs as plain Python (same results, slower)."""
