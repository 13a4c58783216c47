"""Fuzzing the analyzer with random loop-body *source*: a plan, or one of orion_par's own errors with a line.

The requirement: no body makes ``f.plan`` raise anything but the library's own errors, and every construct
it does not support is a ``BadBodyError`` or ``NotParallelizableError`` whose message names the line.

Hypothesis draws a module from a grammar of Python constructs: key unpacking of every arity (``u, i, j =
key`` for a two-field key, starred targets), ``key[5]``, subscripts with slices, ``None``, ``...``, negative
numbers, arrays and booleans, chained comparisons, walrus, lambdas, inner defs and classes, comprehensions
of every kind, ``try``/``except``/``finally``, ``with``, ``while``/``for`` with ``else``, ``break`` and
``continue``, ``match``, ``global``/``nonlocal``, ``del``, ``assert``, ``raise``, f-strings, attributes of
arrays (``W.T[u]``, ``W.shape[0]``, ``V.mT``) and of other globals, in-place methods (``W[u].fill(0)``), numpy
calls, global lists, dicts and scalars, ``return``, ``yield``, ``async def``, unrolled expressions and
``elif`` chains, ``Buffer`` arrays; and helper functions in the same module (writing globals, recursive, with
``*args``/``**kwargs``/defaults, decorated with ``numba.njit`` or a ``functools.wraps`` wrapper), called
directly, through a local name or through an expression.  A third test draws the body itself in unusual
forms (async, a lambda, decorated, nested, with a wrong signature).

Each module is written to ``tmp_path`` and loaded with ``importlib.util.spec_from_file_location`` (its arrays
set as globals first, so that module-level code such as ``def h(x, W=W)`` sees them), and removed from
``sys.modules`` afterwards; the body is decorated with ``parallel_for(DATA)`` (two key fields; sometimes
``ordered=True`` or ``allow_data_parallel=True``) and only ``.plan`` is read (nothing is compiled).  Examples
are derandomized, so every run draws the same modules.  An exception that is not orion_par's propagates with
its own traceback, and the failing body is printed (``note``).  Failures are not shrunk (that takes minutes);
``ORION_FUZZ_SHRINK=1`` shrinks them.

The explicit tests at the end are the smallest bodies the fuzzing found crashing the analyzer (or refused
without a line number), and code hundreds of levels deep (a 600-term sum, a 700-branch ``elif`` chain), too
slow to draw here, that exhausts the recursion limit.
"""

from __future__ import annotations

import importlib.util
import itertools
import linecache
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st

from orion_par import (
    BadBodyError,
    Buffer,
    DistArray,
    NotParallelizableError,
    OrionParError,
    Plan,
    parallel_for,
)

RNG = np.random.default_rng(0)
KEYS = np.stack([RNG.integers(0, 20, 40), RNG.integers(0, 15, 40)], axis=1)  # two key fields (u, i)
DATA = DistArray.from_coo(KEYS, RNG.random(40))

# Shrinking a failure costs minutes (thousands of imports); the explicit tests hold the smallest bodies.
_PHASES = tuple(Phase) if os.environ.get("ORION_FUZZ_SHRINK") else (Phase.explicit, Phase.reuse, Phase.generate)
SETTINGS = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, phases=_PHASES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large],
)
_MODULE_IDS = itertools.count()
_LINE = re.compile(r"\bline\b")
T = TypeVar("T")


def _arrays() -> dict[str, Any]:
    """The module's data, fresh for every module (set as globals before the module runs)."""
    rng = np.random.default_rng(1)
    return {
        "W": DistArray(rng.random((20, 4))),
        "H": DistArray(rng.random((15, 4))),
        "V": DistArray(np.zeros(30)),
        "M": DistArray(np.zeros((20, 15))),
        "S0": DistArray(np.zeros(())),
        "T3": DistArray(np.zeros((20, 15, 2))),
        "B": Buffer(np.zeros(30), max_delay=2),  # updates may be late: its conflicts do not refuse a plan
        "DATA": DATA,  # the dataset itself, as users often keep it in a global
    }


HEADER = '''\
import functools
import math

import numba
import numpy as np
import pytest

K = 4
SCALE = 3
COUNTER = 0
LST = [1, 2, 3]
DCT = {0: 1.0, "k": 2.0}
TUP = (1, 2)
NAME = "orion"


def passthrough(f):
    return f


def wrapping(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


def wrapping_defaults(f):
    @functools.wraps(f)
    def wrapper(a=0, b=1, c=2):
        return f(a)
    return wrapper


class Obj:
    limit = 3

    def __call__(self, x):
        W[x] += 1

    def meth(self, x):
        W[x] += 1

    @property
    def prop(self):
        raise RuntimeError("a property that cannot be read before the loop runs")


OBJ = Obj()


class AttrDict(dict):
    def __getattr__(self, name):
        return self[name]

    def __call__(self, x):
        return x


CFG = AttrDict(lr=0.1)


def hw(x):
    W[x] += 1


def hr(x, y=0):
    return W[x, y]


def hret():
    return W


def hrow(x):
    return H[x]


def hrec(x):
    if x > 0:
        return hrec(x - 1)
    return 0


def hmut1(x):
    return hmut2(x)


def hmut2(x):
    return hmut1(x)


def hstar(*args, **kwargs):
    for a in args:
        V[a] += 1.0
    return kwargs


def hkw(x, /, y=2, *, z=3):
    M[x, y] += z


def hkey(k):
    a, b = k
    T3[a, b, 0] += 1.0


def hkey3(k):
    a, b, c = k
    return a


def hgen(x):
    yield W[x]


async def hasync(x):
    W[x] += 1


def hglobal(x):
    global COUNTER
    COUNTER = x


def hlocal(x):
    f = hw
    f(x)


def hdefault(x, W=W):
    W[x] += 1


def hmutable(x, out=[]):
    out.append(x)


def make_closure():
    A = W

    def inner(x):
        A[x] += 1
    return inner


hclosure = make_closure()


@numba.njit
def hjit(x):
    V[x] += 1.0


@numba.njit(cache=False)
def hjit2(x, y):
    return M[x, y]


@functools.lru_cache
def hcached(x):
    return x


hlam = lambda x: W[x]  # noqa: E731
hpart = functools.partial(hw, 1)
'''


# -- loading --------------------------------------------------------------------------------------------


def _plan_or_error(source: str, folder: Path, **options: bool) -> Plan | OrionParError:
    """Import ``source`` as a module, decorate its ``body`` and read ``.plan``; orion_par's errors are returned,
    anything else propagates.

    Every module of a test is written to the same file, so that an exception raised by the module's own code
    (``Obj.prop``) has the same origin in every example (Hypothesis tells bugs apart by origin); the module gets
    a fresh name, is compiled here (no stale bytecode) and ``linecache`` forgets the previous file.
    """
    name = f"_orion_analyzer_fuzz_{next(_MODULE_IDS)}"
    path = folder / "fuzz_module.py"
    path.write_text(source)
    linecache.cache.pop(str(path), None)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(_arrays())
    sys.modules[name] = module
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # `1 is None` and the like
            exec(compile(source, str(path), "exec"), module.__dict__)
        try:
            return parallel_for(DATA, **options)(module.body).plan
        except OrionParError as e:
            return e
    finally:
        sys.modules.pop(name, None)


def _check(source: str, folder: Path, **options: bool) -> Plan | OrionParError:
    """The property: a Plan, or an OrionParError that names the line."""
    out = _plan_or_error(source, folder, **options)
    if isinstance(out, OrionParError):
        assert _LINE.search(str(out)), f"{type(out).__name__} without a line number: {out}"
    else:
        assert isinstance(out, Plan)
    return out


def _compiles(source: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, "<fuzz>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def _module(helpers: Sequence[str], body: str) -> str:
    return "\n\n".join([HEADER, *helpers, body]) + "\n"


def _indent(lines: Sequence[str], levels: int = 1) -> list[str]:
    return ["    " * levels + ln for ln in lines]


# -- the grammar ------------------------------------------------------------------------------------------

_INTS: dict[tuple[int, int], st.SearchStrategy[int]] = {}


@dataclass(frozen=True)
class Ctx:
    """Where a statement is drawn: nesting left, inside a loop (break/continue), the generated helpers."""

    depth: int = 2
    in_loop: bool = False
    calls: tuple[str, ...] = ()  # generated helpers this code may call


ARRAYS = ("W", "H", "V", "M", "S0", "T3", "B")
KEY_INDICES = ("u", "i", "key[0]", "key[1]", "key[-1]", "key[-2]", "x", "y")
CONST_INDICES = ("0", "1", "-1", "3", "K", "SCALE", "-SCALE", "2 - 3", "True", "False", "0.5", "TUP[0]", "LST[0]")
ODD_INDICES = (
    "None", "...", "V", "V > 0", "[0, 1]", "np.arange(3)", "key", "*key", "r", "n", "int(value)", "len(W)",
    "W.shape[0]", "W.shape[-1] - 1", "key[5]", "key[2]", "key[-3]", "(u, i)", "NAME", "DCT['k']", "-u",
    "u ** 2", "u << 1", "u // 0", "u % 3", "2 * u", "u * 2", "abs(u)", "hr(u)", "(n := u + 1)", "1 << 70",
    "CFG.lr", "OBJ.limit",
)
SLICES = (":", "1:3", "::2", "::-1", "u:u + 2", "u:", ":-1", "key[0]:key[0] + 1", "None:None", "u - 1:u + 1:1",
          "i:u", ":u:2")
ATTRS = ("shape", "T", "mT", "ndim", "size", "dtype", "real", "imag", "flat", "base", "strides", "nbytes",
         "itemsize", "ctypes", "data", "flags", "device", "x")
METHODS_READ = ("sum()", "mean()", "max()", "copy()", "item()", "tolist()", "argmax()", "astype(np.float32)",
                "dot(H[i])", "reshape(-1)", "ravel()", "view()", "transpose()", "round(2)", "clip(0, 1)")
METHODS_WRITE = ("fill(0)", "sort()", "put(0, 1.0)", "resize(3, refcheck=False)", "setflags(write=True)",
                 "__setitem__(0, 1.0)", "__iadd__(1.0)", "itemset(0, 1.0)")
ARRAY_EXPRS = ("W", "H", "V", "M", "S0", "T3", "B", "w", "W[u]", "H[i]", "W[u, :]", "W.T", "V.mT", "np.asarray(W)",
               "V[1:3]", "(W if value else H)", "hret()", "hrow(i)", "LST", "value", "DATA", "OBJ.prop",
               "CFG.missing", "CFG", "globals()['W']")
NP_CALLS = (
    "np.dot({a}, {b})", "np.sum({a})", "np.exp({s})", "np.sqrt(abs({s}))", "np.maximum({s}, 0.0)",
    "np.add({a}, 1.0, out={a})", "np.add({a}, 1.0, {a})", "np.multiply.at(V, u, 2.0)", "np.random.shuffle({a})",
    "np.asarray({a})", "np.ravel({a})", "np.clip({a}, 0, 1, out={a})", "np.copyto({a}, 0.0)", "np.where({a} > 0)",
    "np.random.rand()", "np.zeros(K)", "math.exp({s})", "np.float64({s})", "np.outer({a}, {b})",
    "np.einsum('i,i->', {a}, {b})", "np.linalg.norm({a})", "getattr(np, 'add')({a}, 1, out={a})",
    "np.vectorize(hw)({s})", "exec('W[0] += 1')",
)
FIXED_HELPER_CALLS = (
    "hw(u)", "hr(u)", "hr(u, i % 4)", "hrec(u)", "hmut1(u)", "hstar(u, i, z=1)", "hstar(*key)", "hstar(**DCT)",
    "hkw(u, z=1)", "hkw(u, y=0)", "hkey(key)", "hkey3(key)", "next(hgen(u))", "hglobal(u)", "hlocal(u)",
    "hdefault(u)", "hmutable(u)", "hclosure(u)", "hjit(u)", "hjit2(u, i)", "hjit2(*key)", "hcached(u)", "hlam(u)",
    "hw(x=u)", "hw()", "hw(u, i)", "hr(key)", "hr(*key)", "hr(hr(u))", "(hw if value else hr)(u)", "[hw][0](u)",
    "hasync(u)", "hw.__call__(u)", "hjit.py_func(u)", "OBJ(u)", "OBJ.meth(u)", "hpart()", "CFG(u)",
    "CFG.get('lr')", "V.mT.sum()", "OBJ.prop.sum()",
)


class Grammar:
    """Draws source text; every choice is an index drawn from a cached integer strategy, so that drawing
    stays cheap and shrinking moves towards the first (simplest) option."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def int(self, lo: int, hi: int) -> int:
        strategy = _INTS.get((lo, hi))
        if strategy is None:
            strategy = _INTS[lo, hi] = st.integers(lo, hi)
        return self.draw(strategy)

    def pick(self, options: Sequence[T]) -> T:
        return options[self.int(0, len(options) - 1)]

    def lazy(self, options: Sequence[Callable[[], T]]) -> T:
        return self.pick(options)()

    def coin(self) -> bool:
        return self.int(0, 1) == 1

    # -- expressions ----------------------------------------------------------------------------------
    def index_item(self) -> str:
        pool = self.pick((KEY_INDICES, KEY_INDICES, CONST_INDICES, ODD_INDICES, SLICES))
        item = self.pick(pool)
        if pool is KEY_INDICES and self.coin():
            item = f"{item} {self.pick(('+', '-'))} {self.int(0, 3)}"
        return item

    def subscript(self, base: str | None = None) -> str:
        if base is None:
            base = self.pick((*ARRAYS, "w", "LST", "DCT", "value", "DATA", "key", "CFG"))
            if self.int(0, 5) == 0:  # an attribute, call or expression first: W.T[u], hret()[u], ...
                base = self.pick((f"{base}.T", f"{base}.mT", f"np.asarray({base})", f"{base}.reshape(-1)",
                                  f"(W if value else {base})", f"(W or {base})", "hret()", "hrow(u)", f"{base}[::2]",
                                  "(W, H)[0]", f"{base}.base", f"{base}.flat", "globals()['W']", "OBJ.prop"))
        items = [self.index_item() for _ in range(self.int(1, 3))]
        if self.int(0, 3) == 0:  # chained: W[u][0]
            return base + "".join(f"[{it}]" for it in items)
        return f"{base}[{', '.join(items)}]"

    def scalar(self, depth: int = 2) -> str:
        leaves = ("value", "u", "i", "key[0]", "1.0", "0", "SCALE", "K", "len(LST)", "W.shape[0]", "V.size",
                  "S0[()]", "DCT.get(u, 0)", "LST[u]", "NAME", "r", "x", "float(u)", "int(value)", "len(key)",
                  "COUNTER", "math.pi", "CFG.lr")
        if depth <= 0:
            return self.pick(leaves)
        a = lambda: self.scalar(depth - 1)  # noqa: E731
        return self.lazy((
            lambda: self.pick(leaves),
            self.subscript,
            lambda: f"({a()} {self.pick(('+', '-', '*', '/', '//', '%', '**', '@', '<<', '&'))} {a()})",
            lambda: self.pick(("-", "not ", "~", "+")) + a(),
            lambda: self.lazy((  # chained comparisons, boolean operators, conditional expressions
                lambda: f"0 <= {a()} < {a()}", lambda: f"{a()} == {a()} != {a()}", lambda: f"({a()} and {a()})",
                lambda: f"({a()} or {a()})", lambda: f"({a()} if {a()} else {a()})", lambda: "x is None",
                lambda: f"{a()} in LST", lambda: f"{a()} not in DCT")),
            lambda: f"(n := {a()})",
            lambda: self.lazy((
                lambda: f"(lambda z: z + {a()})(1)", lambda: f"(lambda: {self.subscript()})()",
                lambda: "(lambda z=W: z[u, 0])()", lambda: "(lambda *a, **k: len(a))(*key)")),
            self.comprehension,
            lambda: self.lazy((
                lambda: f"f'{{{a()}}} {{{a()}!r:>8}}'", lambda: f"f'{{{a()}=}}'", lambda: "f'{W[u, 0]:.{K}f}'")),
            lambda: f"{self.pick(ARRAY_EXPRS)}.{self.pick(ATTRS)}",
            lambda: f"{self.pick(ARRAY_EXPRS)}.{self.pick(METHODS_READ)}",
            lambda: self.pick(NP_CALLS).format(a=self.pick(ARRAY_EXPRS), b=self.pick(ARRAY_EXPRS), s=a()),
            lambda: self.lazy((
                lambda: f"abs({a()})", lambda: f"min({a()}, {a()})", lambda: "max(*key)", lambda: f"round({a()})",
                lambda: "sorted(LST, key=lambda z: -z)[0]", lambda: f"isinstance({a()}, int)",
                lambda: "getattr(W, 'shape')[0]", lambda: "type(W).__name__", lambda: f"print({a()}, sep='')",
                lambda: "id(W)", lambda: "hash(TUP)", lambda: "len(W[u])", lambda: "next(iter(W))",
                lambda: "divmod(u, 2)[0]", lambda: "globals()['W'][u, 0]", lambda: "OBJ.prop")),
            lambda: self.pick(FIXED_HELPER_CALLS),
            lambda: self.lazy((  # tuples, lists, sets, dicts with starred items
                lambda: f"({a()}, {a()})", lambda: f"[{a()}, *key]", lambda: f"({a()}, *key)",
                lambda: f"{{{a()}, {a()}}}", lambda: "{**DCT, 'z': u}")),
            lambda: self.pick(("(yield)", f"(yield {a()})", "(yield from W[u])")),
            lambda: " + ".join(f"W[u, {j % 4}] * H[i, {j % 4}]"  # an unrolled dot product
                               for j in range(self.pick((2, 8, 40))))
        ))

    def comprehension(self) -> str:
        it = self.pick(("range(K)", "key", "W", "W[u]", "LST", "zip(W, H)", "enumerate(V)", "range(u, u + 2)",
                        "range(*key)", "DCT.items()"))
        tgt = self.pick(("r", "(r, s)", "[r, *s]", "r.x"))
        cond = self.lazy((lambda: "", lambda: f" if {self.scalar(1)}", lambda: " if r > 0 if r < 3",
                          lambda: f" for q in range(2) if {self.scalar(1)}"))
        e = self.scalar(1)
        return self.pick((f"[{e} for {tgt} in {it}{cond}]", f"{{{e} for {tgt} in {it}{cond}}}",
                          f"{{r: {e} for {tgt} in {it}{cond}}}", f"sum({e} for {tgt} in {it}{cond})"))

    def target(self) -> str:
        return self.pick(("x", "w", "n", "u", "i", "a, b", "(a, b)", "[a, b]", "a, *b", "*a, b", "a, *b, c",
                          "(a, b), c", "x.attr", "LST[0]", "DCT['k']", "w[0]", "w[...]", "value", "value[0]"))

    # -- statements -----------------------------------------------------------------------------------
    def simple(self, ctx: Ctx) -> list[str]:
        s = self.scalar
        options: list[Callable[[], list[str]]] = [
            lambda: [f"{self.subscript(self.pick(ARRAYS))} {self.pick(('=', '+=', '-=', '*='))} {s()}"],
            lambda: [f"{self.target()} = {s()}"],
            lambda: [f"{self.pick(KEY_TARGETS)} = {self.pick(KEY_VALUES)}"],  # unpacking the key, every arity
            lambda: [f"w = {self.pick(ARRAY_EXPRS)}", f"w {self.pick(('+=', '*=', '='))} {s()}"],
            lambda: [f"w = {self.subscript()}", f"{self.pick(('w', 'w[0]', 'w[:]', 'w[r]'))} += {s()}"],
            lambda: [f"{self.pick(ARRAY_EXPRS)}.{self.pick(METHODS_WRITE)}"],
            lambda: [f"{self.subscript()}.{self.pick(METHODS_READ + METHODS_WRITE)}"],
            lambda: [self.lazy((
                lambda: f"LST.append({s()})", lambda: f"DCT[u] = {s()}", lambda: f"LST[u] += {s()}",
                lambda: "DCT.update(k=1)", lambda: "LST.sort()", lambda: "W.x = 1", lambda: "W.shape = (4, 20)",
                lambda: "x: float = 0.0", lambda: f"x: int = {s()}", lambda: "x: int",
                lambda: f"w: np.ndarray = W[{self.index_item()}]", lambda: f"a = b = {s()}", lambda: "a, b = b, a",
                lambda: "x = y = W[u]", lambda: "value += 1", lambda: "value[0] = 1.0", lambda: "u, i = i, u",
                lambda: "W[u], H[i] = H[i], W[u]", lambda: "globals()['W'][0] += 1"))],
            lambda: [self.pick(("del x", "del W[u]", "del DCT[u]", "del LST[0], x", "del key", "del w.x",
                                "del value"))],
            lambda: [self.lazy((lambda: f"assert {s()}, 'message'", lambda: f"assert {s()}",
                                lambda: f"raise ValueError({s()})", lambda: "raise", lambda: "raise ValueError from None",
                                lambda: "pass", lambda: f"print({s()})"))],
            lambda: [self.lazy((lambda: "return", lambda: f"return {s()}", lambda: "return W", lambda: "return W[u]",
                                lambda: f"yield {s()}", lambda: "yield", lambda: f"x = yield {s()}",
                                lambda: "yield from W[u]", lambda: "return key"))],
            lambda: [self.pick(("global COUNTER", "global W", "global LST")),
                     self.pick(("COUNTER = 1", "COUNTER += 1", "W = H", "LST = []", "pass"))],
            lambda: [self.pick(("import math as mm", "from numpy import add", "import numpy.linalg",
                                "from math import exp"))],
            lambda: [f"f = {self.pick(('hw', 'hr', 'hjit', 'hstar', 'OBJ', 'np.add', 'abs', *ctx.calls))}",
                     f"f({self.pick(('u', '*key', 'W, 1, out=W', 'u, i'))})"],  # a call through a local name
            lambda: [s()],
        ]
        if ctx.in_loop:
            options.append(lambda: [self.pick(("break", "continue"))])
        if ctx.calls:
            options.append(lambda: self.generated_call(ctx))
        return self.lazy(options)

    def generated_call(self, ctx: Ctx) -> list[str]:
        g = self.pick(ctx.calls)
        args = self.pick(("u", "u, i", "*key", "key", "x=u", "u, y=i", "**DCT", "W[u]", "W", "", "u, i, 1, 2",
                          "g0", "key[0] + 1"))
        form = self.pick(("{g}({a})", "x = {g}({a})", "x = {g}({a})\nx[0] += 1", "[{g}(r) for r in key]",
                          "{g}({g}({a}))", "(lambda: {g}({a}))()", "x = {g}", "next(iter([{g}]))(u)"))
        return form.format(g=g, a=args).split("\n")

    def block(self, ctx: Ctx, lo: int = 1, hi: int = 4) -> list[str]:
        out: list[str] = []
        for _ in range(self.int(lo, hi)):
            out += self.statement(ctx)
        return out or ["pass"]

    def statement(self, ctx: Ctx) -> list[str]:
        if ctx.depth <= 0 or self.int(0, 2) > 0:
            return self.simple(ctx)
        inner = replace(ctx, depth=ctx.depth - 1)
        return self.lazy((
            lambda: self.if_(inner), lambda: self.for_(inner), lambda: self.while_(inner), lambda: self.try_(inner),
            lambda: self.with_(inner), lambda: self.match_(inner), lambda: self.inner_def(inner),
            lambda: self.async_def(), lambda: self.class_def(), lambda: self.lambda_(),
            lambda: ["w = W[u]", f"for r in range({self.pick(('K', 'u', '2'))}):",
                     *_indent(self.block(replace(inner, in_loop=True))), "w[0] += 1"],
            lambda: self.elif_chain(),
        ))

    def if_(self, ctx: Ctx) -> list[str]:
        out = [f"if {self.scalar(1)}:", *_indent(self.block(ctx))]
        if self.coin():
            out += [f"elif {self.scalar(1)}:", *_indent(self.block(ctx))]
        if self.coin():
            out += ["else:", *_indent(self.block(ctx))]
        return out

    def elif_chain(self) -> list[str]:
        # Chains of hundreds of branches (generated code) are in the explicit tests: they are slow to shrink.
        return ["if value < 0:", "    x = 0",
                *(ln for k in range(1, self.int(2, 12)) for ln in (f"elif value < {k}:", f"    W[u, {k % 4}] += {k}"))]

    def for_(self, ctx: Ctx) -> list[str]:
        tgt = self.pick(("r", "(r, s)", "r, *s", "w", "u", "W[0]", "x.attr"))
        it = self.pick(("range(K)", "range(u, u + 2)", "range(key[0] - 1, key[0] + 2)", "range(0, K, 2)",
                        "range(*key)", "W", "W[u]", "key", "LST", "zip(W, H)", "enumerate(V)", "DCT", "reversed(W)",
                        "np.nditer(W)", "hgen(u)", "range(n := 3)", "V.mT"))
        out = [f"for {tgt} in {it}:", *_indent(self.block(replace(ctx, in_loop=True)))]
        if self.coin():
            out += ["else:", *_indent(self.block(ctx))]
        return out

    def while_(self, ctx: Ctx) -> list[str]:
        cond = self.pick(("True", "n < 3", "(n := n - 1) > 0", "V[u] > 0", "LST"))
        out = [f"while {cond}:", *_indent(self.block(replace(ctx, in_loop=True))), *_indent(["break"][:self.int(0, 1)])]
        if self.coin():
            out += ["else:", *_indent(self.block(ctx))]
        return out

    def try_(self, ctx: Ctx) -> list[str]:
        star = self.pick(("", "", "*"))
        out = ["try:", *_indent(self.block(ctx))]
        handlers = self.int(1 if star else 0, 2)
        for _ in range(handlers):
            exc = self.pick(("Exception", "(ValueError, KeyError) as e", "IndexError as err", "ValueError"))
            if not star and self.coin():
                exc = ""
            out += [f"except{star} {exc}".rstrip() + ":", *_indent(self.block(ctx))]
        if handlers and self.coin():
            out += ["else:", *_indent(self.block(ctx))]
        if not handlers or self.coin():
            out += ["finally:", *_indent(self.block(ctx))]
        return out

    def with_(self, ctx: Ctx) -> list[str]:
        item = self.pick(("np.errstate(all='ignore')", "np.errstate(all='ignore') as es", "open(NAME) as (a, b)",
                          "W as ww", "OBJ as o, W[u] as wu", "numba.objmode()",
                          "np.nditer(W, op_flags=['readwrite']) as it"))
        return [f"with {item}:", *_indent(self.block(ctx))]

    def match_(self, ctx: Ctx) -> list[str]:
        out = [f"match {self.pick(('key', 'value', 'u', 'W[u]', '(u, i)', 'DCT', 'LST'))}:"]
        for _ in range(self.int(1, 3)):
            pattern = self.pick(("0", "(a, b)", "[a, *rest]", "{'k': v}", "int(z)", "a if a > 0", "np.ndarray()",
                                 "math.pi", "(0 | 1) as z", "[W, H]", "str() | bytes()"))
            out += _indent([f"case {pattern}:", *_indent(self.block(ctx))])
        if self.coin():
            out += _indent(["case _:", *_indent(self.block(ctx))])
        return out

    def inner_def(self, ctx: Ctx) -> list[str]:
        params = self.pick(("", "z", "z=W", "*a, **kw", "u"))
        deco = self.pick(([], ["@passthrough"], ["@numba.njit"], ["@functools.lru_cache"]))
        body = self.block(replace(ctx, in_loop=False))
        if self.coin():
            body = ["nonlocal n", "n = 1", *body]
        call = self.pick(([], ["inner()"], ["inner(u)"], ["x = inner"], ["f = inner", "f()"]))
        return ["n = 0", *deco, f"def inner({params}):", *_indent(body), *call]

    def async_def(self) -> list[str]:
        inner = self.pick((["await z", "W[u] += 1"], ["async with z as q:", "    W[q] += 1"],
                           ["async for q in z:", "    V[q] += 1"], ["return W[z]"]))
        return ["async def coro(z):", *_indent(inner), *self.pick(([], ["coro(u)"], ["x = coro(W)"]))]

    def class_def(self) -> list[str]:
        inner = self.pick((["W[0] += 1"], ["x = W[u]", "def m(self):", "    W[u] += 1"], ["attr = SCALE"], ["pass"]))
        return ["class Inner:", *_indent(inner), *self.pick(([], ["Inner()"], ["Inner().m()"]))]

    def lambda_(self) -> list[str]:
        return [f"f = lambda {self.pick(('z', 'z=W', '*a', ''))}: {self.scalar(1)}",
                self.pick(("f(u)", "f()", "x = f", "W[u] += f(u)"))]


KEY_TARGETS = ("u, i", "u, i, j", "u,", "(u, i)", "[u, i]", "u, *rest", "*rest, i", "u, *rest, i", "*rest, u, i, j",
               "u, (i, j)", "(u, i), j", "u = i")
KEY_VALUES = ("key", "tuple(key)", "key[::-1]", "key[0], key[1]", "list(key)", "*key,", "key if value else (0, 0)")
HELPER_SIGNATURES = ("x", "x, y=1", "x, *args, **kwargs", "x, /, y=2, *, z=3", "x, W=W", "x, out=[]", "W, x",
                     "*args", "x=0, y=0", "x, y", "key, value")
HELPER_DECORATORS = ((), (), (), ("@numba.njit",), ("@numba.njit(cache=False)",), ("@numba.jit(nopython=True)",),
                     ("@passthrough",), ("@wrapping",), ("@wrapping_defaults",), ("@functools.lru_cache",),
                     ("@staticmethod",))


def _body_source(lines: Sequence[str], head: str = "def body(key, value):") -> str:
    return "\n".join([head, *_indent(lines)])


@st.composite
def statement_modules(draw: st.DrawFn) -> str:
    """The code after ``HEADER``: a body using the constructs of the grammar (and the helpers of ``HEADER``)."""
    code = _body_source(Grammar(draw).block(Ctx(depth=2), 1, 6))
    assume(_compiles(_module([], code)))
    return code


@st.composite
def helper_modules(draw: st.DrawFn) -> str:
    """0-3 generated helpers ``g0, g1, ...`` (random signatures, decorators and bodies; they may call each other
    and themselves) and a body that calls them."""
    g = Grammar(draw)
    names = tuple(f"g{k}" for k in range(g.int(0, 3)))
    helpers = []
    for name in names:
        lines = g.block(Ctx(depth=1, calls=names), 1, 3)
        if g.coin():
            lines.insert(0, f"{g.pick(names)}({g.pick(('x', 'x - 1', '*args', ''))})")  # maybe itself
        if g.coin():
            lines.append(f"return {g.pick(('x', 'W[x]', 'W', 'x + 1', 'H[x, 0]', 'args', 'None'))}")
        kw = g.pick(("def", "def", "def", "async def"))
        helpers.append("\n".join([*g.pick(HELPER_DECORATORS), f"{kw} {name}({g.pick(HELPER_SIGNATURES)}):",
                                  *_indent(lines)]))
    ctx = Ctx(depth=1, calls=names)
    lines = list(g.pick((["u, i = key"], [], ["u = key[0]", "i = key[1]"])))
    for _ in range(g.int(1, 3)):
        lines += g.generated_call(ctx) if names and g.coin() else g.statement(ctx)
    code = "\n\n".join([*helpers, _body_source(lines)])
    assume(_compiles(_module([], code)))
    return code


BODY_HEADS = (
    "def body(key, value):", "async def body(key, value):", "@passthrough\ndef body(key, value):",
    "@wrapping\ndef body(key, value):", "def body(key, value, extra):", "def body(key, value=None):",
    "def body(key, /, value):", "def body(*key_value):", "def body(key, value, *, k=1):",
    "def body(key, value):\n    pass\n\n\ndef body(key, value):", "@numba.njit\ndef body(key, value):",
    "if True:\n    def body(key, value):", "class Holder:\n    @staticmethod\n    def body(key, value):",
    "body = lambda key, value: (",
)


@st.composite
def body_form_modules(draw: st.DrawFn) -> str:
    """The body itself in unusual forms: async, a lambda, decorated, nested, with a wrong signature."""
    g = Grammar(draw)
    head = g.pick(BODY_HEADS)
    if head.startswith("body = lambda"):
        body = f"{head}{g.scalar(1)})"
    else:
        last = head.splitlines()[-1]
        levels = (len(last) - len(last.lstrip())) // 4 + 1
        body = "\n".join([head, *_indent(g.block(Ctx(depth=1), 1, 3), levels)])
        if head.startswith("class Holder"):
            body += "\n\n\nbody = Holder.body"
    assume(_compiles(_module([], body)))
    return body


# -- the properties -------------------------------------------------------------------------------------


OPTIONS = st.sampled_from(({}, {"ordered": True}, {"allow_data_parallel": True}))  # parallel_for's flags


@SETTINGS
@given(code=statement_modules(), options=OPTIONS)
def test_any_body_gets_a_plan_or_a_library_error_with_its_line(tmp_path, code, options):
    note(code)
    _check(_module([], code), tmp_path, **options)


@SETTINGS
@given(code=helper_modules(), options=OPTIONS)
def test_any_body_calling_helpers_gets_a_plan_or_a_library_error_with_its_line(tmp_path, code, options):
    note(code)
    _check(_module([], code), tmp_path, **options)


@SETTINGS
@given(code=body_form_modules())
def test_any_form_of_body_gets_a_plan_or_a_library_error_with_its_line(tmp_path, code):
    note(code)
    _check(_module([], code), tmp_path)


def _body(*lines: str, helpers: str = "") -> str:
    return _module([textwrap.dedent(helpers).strip()] if helpers else [], _body_source(lines))


def test_the_harness_reaches_plans_and_both_refusals(tmp_path):
    """The properties are not satisfied vacuously: the same harness makes plans and both kinds of refusal."""
    plan = _check(_body("u, i = key", "W[u] += H[i]", "H[i] += W[u]"), tmp_path)
    assert isinstance(plan, Plan) and plan.scheme == "2d"
    assert isinstance(_check(_body("V[0] += value"), tmp_path), NotParallelizableError)
    assert isinstance(_check(_body("u, i, j = key"), tmp_path), BadBodyError)
    assert isinstance(_check(_body("x = key[5]"), tmp_path), BadBodyError)
    assert isinstance(_check(_body("hrec(key[0])"), tmp_path), NotParallelizableError)


# -- regressions: the smallest bodies the fuzzing found crashing the analyzer ------------------------------
#
# Each body below made ``f.plan`` raise something other than an OrionParError (or an OrionParError without a
# line number).  Those the library could accept also write ``V[0]`` in every iteration, a conflict no plan can
# keep: whatever the analyzer makes of the construct itself, the answer is then a library error with a line.

ALWAYS_REFUSED = "V[0] += value"


def _assert_library_error(tmp_path: Path, code: str, kind: type[OrionParError] = OrionParError) -> None:
    out = _plan_or_error(_module([], code), tmp_path)  # a crash propagates with its own traceback
    assert isinstance(out, kind), f"expected {kind.__name__}, got {out!r}"
    assert _LINE.search(str(out)), f"{type(out).__name__} without a line number: {out}"


@pytest.mark.parametrize("line", ["x = V.mT", "x = OBJ.prop", "x = CFG.missing"],
                         ids=["numpy-mT-of-1d-ValueError", "property-RuntimeError", "getattr-KeyError"])
def test_an_attribute_whose_lookup_raises_is_a_library_error(tmp_path, line):
    # expressions.ExprEvaluator.resolve_object: getattr(base, attr, None) lets any exception but AttributeError
    # escape (numpy raises ValueError for a 1-D array's .mT; user properties and __getattr__ raise anything).
    _assert_library_error(tmp_path, _body_source([line, ALWAYS_REFUSED]))


@pytest.mark.parametrize("line", ["x = V.mT.sum()", "OBJ.prop.fill(0)", "CFG.sort()"],
                         ids=["numpy-mT-of-1d-ValueError", "property-RuntimeError", "getattr-KeyError"])
def test_calling_a_method_of_an_attribute_whose_lookup_raises_is_a_library_error(tmp_path, line):
    # helpers.call_target (through body_graph/discover, before the analysis): getattr(base, attr, None) again.
    _assert_library_error(tmp_path, _body_source([line, ALWAYS_REFUSED]))


def test_calling_an_object_whose_getattr_raises_key_error_is_a_library_error(tmp_path):
    # purity.is_declared_pure (from helpers.opaque_callable): getattr(obj, "__orion_pure__", False) on a
    # callable whose __getattr__ raises KeyError (an attribute dict).
    _assert_library_error(tmp_path, _body_source(["x = CFG(key[0])", ALWAYS_REFUSED]))


def test_a_helper_parameter_defaulting_to_a_global_array_of_the_same_name_is_a_library_error(tmp_path):
    # `def hdefault(x, W=W)`: the helper's W is modelled as a 0-d object named "W", the body's as the 2-d
    # array W; dependence.conflict_box then zips subscripts of different lengths (zip(strict=True): ValueError).
    _assert_library_error(tmp_path, _body_source(["hdefault(key[0])", "x = W[key[0], 0]", ALWAYS_REFUSED]))


def test_a_helper_wrapped_by_a_functools_wraps_wrapper_with_more_defaults_is_a_library_error(tmp_path):
    # inspect reads the wrapped def (one parameter) but __defaults__ are the wrapper's (three):
    # analyzer._bind_params zips them with strict=True (ValueError).
    helper = "@wrapping_defaults\ndef g0(x):\n    V[x] += 1.0"
    _assert_library_error(tmp_path, helper + "\n\n\n" + _body_source(["g0(key[0])", ALWAYS_REFUSED]))


@pytest.mark.parametrize("lines", [
    ["x = value" + " + W[key[0], 0]" * 600],
    ["if value < 0:", "    x = 0", *(ln for k in range(1, 700) for ln in (f"elif value < {k}:", f"    x = {k}"))],
], ids=["600-term-sum", "700-branch-elif-chain"])
def test_long_generated_code_is_a_library_error_or_a_plan_not_a_recursion_error(tmp_path, lines):
    # The evaluator and the statement walker recurse once per nested node (expressions.use/eval,
    # analyzer.walk/stmt_If/branch): code that Python compiles fine exhausts the recursion limit.
    _assert_library_error(tmp_path, _body_source([*lines, ALWAYS_REFUSED]))


@pytest.mark.parametrize("code", [
    "async def body(key, value):\n    V[key[0]] += value",
    "body = lambda key, value: V.__setitem__(key[0], value)",
    "@numba.njit\ndef body(key, value):\n    V[key[0]] += value",
], ids=["async-def", "lambda", "numba-njit"])
def test_a_body_that_is_not_a_plain_def_is_refused_with_its_line(tmp_path, code):
    # body.load_body: "is not a plain `def` (async or class?)", "needs a `def` body, not a lambda" and
    # "got CPUDispatcher" name no line.
    _assert_library_error(tmp_path, code, BadBodyError)


def test_writing_the_dataset_through_a_global_is_refused_with_its_line(tmp_path):
    # checks.check_no_aliases: "the body writes `DATA`, which may share memory with the dataset's values"
    # names no line (the write's line is known: it is an access of the analysis).
    _assert_library_error(tmp_path, _body_source(["DATA[key[0]] = value"]), BadBodyError)
