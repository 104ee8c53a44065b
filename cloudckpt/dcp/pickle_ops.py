"""The opcode table of the bounded pickle interpreter (:mod:`cloudckpt.dcp.unpickle`, whose
doc is the contract): what each opcode outside the parser's inlined ones does, and the refusals.
Handlers take the parser (:mod:`cloudckpt.dcp.pickle_parser`) and return its ``STOP`` at the
end of the pickle."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from cloudckpt.dcp.pickle_parser import COST_SCALAR, STOP, Parser
from cloudckpt.errors import ManifestError

_I4, _U4, _U8 = struct.Struct("<i"), struct.Struct("<I"), struct.Struct("<Q")
_F8 = struct.Struct(">d")


def _u(fmt: struct.Struct):
    return lambda p: fmt.unpack(p.take(fmt.size))[0]


_u1 = lambda p: p.take(1)[0]  # noqa: E731
_u2 = lambda p: int.from_bytes(p.take(2), "little")  # noqa: E731
_i4, _u4, _u8 = _u(_I4), _u(_U4), _u(_U8)


def _refuse(why: str):
    def handler(p: Parser):
        raise p.fail(why)

    return handler


def _persistent(p: Parser):
    raise ManifestError(
        "holds a persistent id, which DCP metadata never does: not unpickled", path=p.where
    )


def _frame(p: Parser):
    p.take(8)  # frames only group opcodes: the length needs no checking beyond truncation


def _text_global(p: Parser):
    try:
        module, name = p.line().decode("ascii"), p.line().decode("ascii")
    except UnicodeDecodeError as exc:
        raise p.fail("a global with a name that is not ASCII") from exc
    p.op_global(module, name)


def _tuple_of(n: int):
    def handler(p: Parser):
        items = [p.pop() for _ in range(n)][::-1]
        p.push(p.container("t", items), 0)

    return handler


def _bytes_of(read):
    def handler(p: Parser):
        raw = read(p)
        p.push(raw, COST_SCALAR + len(raw))

    return handler


def _setitem(p: Parser):
    value, key = p.pop(), p.pop()
    p.op_setitems([key, value])


def _append(p: Parser):
    p.op_appends([p.pop()])


def _pop_mark_to(kind: str):
    return lambda p: p.push(p.container(kind, p.pop_mark()), 0)


OPS: dict[int, Callable[[Parser], Any]] = {
    0x80: lambda p: p.take(1),  # PROTO
    0x95: _frame,  # FRAME
    ord("."): lambda p: STOP,  # STOP
    ord("("): lambda p: p.op_mark(),  # MARK
    ord("0"): lambda p: p.pop(),  # POP
    ord("1"): lambda p: p.pop_mark(),  # POP_MARK
    ord("2"): lambda p: p.push(p.stack[-1] if p.stack else p.pop(), 0),  # DUP
    ord("I"): lambda p: p.op_int_text(),  # INT
    ord("L"): lambda p: p.op_int_text(),  # LONG
    ord("J"): lambda p: p.push(_i4(p)),  # BININT
    ord("K"): lambda p: p.push(_u1(p), 0),  # BININT1 (cached ints)
    ord("M"): lambda p: p.push(_u2(p)),  # BININT2
    0x8A: lambda p: p.op_long_bin(_u1(p)),  # LONG1
    0x8B: lambda p: p.op_long_bin(_i4(p)),  # LONG4
    ord("F"): lambda p: p.op_float_text(),  # FLOAT
    ord("G"): lambda p: p.push(_F8.unpack(p.take(8))[0]),  # BINFLOAT
    ord("N"): lambda p: p.push(None, 0),  # NONE
    0x88: lambda p: p.push(True, 0),  # NEWTRUE
    0x89: lambda p: p.push(False, 0),  # NEWFALSE
    ord("S"): lambda p: p.op_string_text(),  # STRING
    ord("T"): lambda p: p.push_text(p.sized(_I4), "ascii"),  # BINSTRING
    ord("U"): lambda p: p.push_text(p.take(_u1(p)), "ascii"),  # SHORT_BINSTRING
    ord("V"): lambda p: p.push_text(p.line(), "raw-unicode-escape"),  # UNICODE
    ord("X"): lambda p: p.push_text(p.sized(_U4), "utf-8", "surrogatepass"),  # BINUNICODE
    0x8C: lambda p: p.push_text(p.take(_u1(p)), "utf-8", "surrogatepass"),  # SHORT_BINUNICODE
    0x8D: lambda p: p.push_text(p.sized(_U8), "utf-8", "surrogatepass"),  # BINUNICODE8
    ord("B"): _bytes_of(lambda p: p.sized(_U4)),  # BINBYTES
    ord("C"): _bytes_of(lambda p: p.take(_u1(p))),  # SHORT_BINBYTES
    0x8E: _bytes_of(lambda p: p.sized(_U8)),  # BINBYTES8
    ord(")"): lambda p: p.push(p.container("t", []), 0),  # EMPTY_TUPLE
    ord("t"): _pop_mark_to("t"),  # TUPLE
    0x85: _tuple_of(1),
    0x86: _tuple_of(2),
    0x87: _tuple_of(3),  # TUPLE1-3
    ord("]"): lambda p: p.push(p.container("l", []), 0),  # EMPTY_LIST
    ord("l"): _pop_mark_to("l"),  # LIST
    ord("a"): _append,  # APPEND
    ord("e"): lambda p: p.op_appends(p.pop_mark()),  # APPENDS
    ord("}"): lambda p: p.push(p.container("d", []), 0),  # EMPTY_DICT
    ord("d"): lambda p: _dict_of(p, p.pop_mark()),  # DICT
    ord("s"): _setitem,  # SETITEM
    ord("u"): lambda p: p.op_setitems(p.pop_mark()),  # SETITEMS
    ord("c"): _text_global,  # GLOBAL
    0x93: lambda p: p.op_stack_global(),  # STACK_GLOBAL
    ord("R"): lambda p: p.op_call("r"),  # REDUCE
    0x81: lambda p: p.op_call("n"),  # NEWOBJ
    ord("b"): lambda p: p.op_build(),  # BUILD
    ord("p"): lambda p: p.op_put(p.number(p.line())),  # PUT
    ord("q"): lambda p: p.op_put(_u1(p)),  # BINPUT
    ord("r"): lambda p: p.op_put(_u4(p)),  # LONG_BINPUT
    0x94: lambda p: p.op_put(len(p.memo)),  # MEMOIZE
    ord("g"): lambda p: p.op_get(p.number(p.line())),  # GET
    ord("h"): lambda p: p.op_get(_u1(p)),  # BINGET
    ord("j"): lambda p: p.op_get(_u4(p)),  # LONG_BINGET
    ord("P"): _persistent,
    ord("Q"): _persistent,  # PERSID, BINPERSID
}
for _op, _why in (
    (0x8F, "a set"),
    (0x90, "a set"),
    (0x91, "a frozenset"),
    (0x82, "an extension code"),
    (0x83, "an extension code"),
    (0x84, "an extension code"),
    (0x96, "a bytearray"),
    (0x97, "an out-of-band buffer"),
    (0x98, "an out-of-band buffer"),
    (ord("i"), "an INST call"),
    (ord("o"), "an OBJ call"),
    (0x92, "a NEWOBJ_EX call"),
):
    OPS[_op] = _refuse(f"holds {_why}, which DCP metadata never does")


def _dict_of(p: Parser, items: list) -> None:
    if len(items) % 2:
        raise p.fail("DICT with an odd number of values")
    p.push(p.container("d", items), 0)
