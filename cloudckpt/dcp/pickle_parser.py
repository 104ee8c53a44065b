"""The bounded pickle interpreter's machine: :class:`Node` (an inert value) and :class:`Parser`
(stack, memo, marks, budgets, the inlined opcodes). The contract is :mod:`cloudckpt.dcp.unpickle`'s;
the other opcodes come from the table it hands in (:data:`cloudckpt.dcp.pickle_ops.OPS`)."""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable
from typing import Any

from cloudckpt.errors import ManifestError

# estimated bytes held per thing built (a CPython object and the pointers to it)
COST_SCALAR, COST_NODE, COST_REF = 48, 144, 8

#: what a handler returns at the end of the pickle
STOP = object()

_MAX_DIGITS = 64
#: What every refusal tells the user to do.
FIX = (
    "a damaged or hostile file: copy the checkpoint again from where it was written, or "
    "save it again"
)


class Node:
    """An inert pickle value. ``kind``: ``"t"`` tuple, ``"l"`` list, ``"d"`` dict (``items`` are
    keys and values in turn), ``"g"`` global (``ref`` is what ``resolve`` returned), ``"r"``
    REDUCE / ``"n"`` NEWOBJ of global ``ref`` with ``args`` (a tuple node), ``state`` (BUILD)
    and ``items`` (appends or set items sent to the object, in order). ``weight``: size as a
    tree; ``depth``: nesting."""

    __slots__ = ("kind", "items", "ref", "args", "state", "weight", "depth", "sealed")

    def __init__(self, kind: str, items: list | None = None, ref: Any = None, args=None):
        self.kind, self.items, self.ref, self.args = (
            kind,
            items if items is not None else [],
            ref,
            args,
        )
        self.state = None
        self.weight, self.depth, self.sealed = 1, 1, False


class Parser:
    def __init__(
        self,
        data,
        resolve: Callable[[str, str], Any],
        where: str,
        max_depth: int,
        max_nodes: int,
        max_cost: int,
        *,
        ops: dict[int, Callable[[Parser], Any]],
    ):
        self.data = bytes(data)
        self.ops = ops  # the opcodes not inlined in run (pickle_ops.OPS)
        self.pos = 0
        self.resolve, self.where = resolve, where
        self.max_depth, self.max_nodes, self.max_cost = max_depth, max_nodes, max_cost
        self.cost = 0
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []

    def fail(self, why: str):
        return ManifestError(f"{why}: not unpickled ({FIX})", path=self.where)

    def spend(self, n: int) -> None:
        self.cost += n
        if self.cost > self.max_cost:
            raise self.fail(f"would take more than {self.max_cost} bytes of memory to decode")

    # -- reading the stream --------------------------------------------------------------------

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail("truncated")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def line(self) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + 4096)
        if end < 0:
            raise self.fail("a text field without its end of line")
        out = self.data[self.pos : end]
        self.pos = end + 1
        return out

    def sized(self, st: struct.Struct) -> bytes:
        (n,) = st.unpack(self.take(st.size))
        if n > len(self.data) - self.pos:
            raise self.fail("a string or bytes field longer than the file")
        return self.take(n)

    # -- the stack -----------------------------------------------------------------------------

    def push(self, value, cost: int = COST_SCALAR) -> None:
        self.cost += cost + COST_REF
        if self.cost > self.max_cost:
            self.spend(0)
        self.stack.append(value)

    def pop(self):
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("pops an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list:
        if not self.marks:
            raise self.fail("no mark to pop to")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def top_node(self, kinds: str) -> Node:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("pops an empty stack")
        node = self.stack[-1]
        if type(node) is not Node or node.kind not in kinds:
            raise self.fail("adds to or sets the state of something that cannot take it")
        if node.sealed:
            raise self.fail("changes an object after it was used (or puts one into itself)")
        return node

    def adopt(self, parent: Node, children) -> None:
        """``children`` become part of ``parent``: sealed, counted in its weight and depth."""
        weight, depth = parent.weight, parent.depth
        for child in children:
            if type(child) is Node:
                child.sealed = True
                weight += child.weight
                if child.depth >= depth:
                    depth = child.depth + 1
            else:
                weight += 1
        if parent.sealed:  # a container put into itself
            raise self.fail("changes an object after it was used (or puts one into itself)")
        if depth > self.max_depth:
            raise self.fail(f"nests deeper than {self.max_depth}")
        if weight > self.max_nodes:
            raise self.fail(
                f"holds more than {self.max_nodes} values (counted as a tree, a "
                "shared one each time it is used)"
            )
        parent.weight, parent.depth = weight, depth

    def container(self, kind: str, items: list) -> Node:
        node = Node(kind)
        self.spend(COST_NODE + COST_REF * len(items))
        self.adopt(node, items)
        node.items = items
        return node

    def extend(self, node: Node, items: list) -> None:
        self.spend(COST_REF * len(items))
        self.adopt(node, items)
        node.items.extend(items)

    # -- opcodes -------------------------------------------------------------------------------

    def run(self):
        # the commonest opcodes of a DCP .metadata inline, the others through OPS
        data, ops, stack, memo = self.data, self.ops, self.stack, self.memo
        n = len(data)
        while self.pos < n:
            op = data[self.pos]
            self.pos += 1
            if op == 0x94:  # MEMOIZE
                if not stack:
                    raise self.fail("memoizes an empty stack")
                memo.append(stack[-1])
                self.spend(COST_REF)
            elif op == 0x8C:  # SHORT_BINUNICODE
                self.push_text(self.take(self.take(1)[0]), "utf-8", "surrogatepass")
            elif op == 0x68:  # BINGET
                self.op_get(self.take(1)[0])
            elif op == 0x4B:  # BININT1
                self.push(self.take(1)[0], 0)
            else:
                handler = ops.get(op)
                if handler is None:
                    raise self.fail(
                        f"uses pickle opcode {bytes([op])!r}, which DCP metadata never holds"
                    )
                if handler(self) is STOP:
                    if len(stack) != 1 or self.marks:
                        raise self.fail("ends with a stack of other than one value")
                    return stack[0]
        raise self.fail("truncated (no STOP)")

    def op_int_text(self):
        text = self.line()
        if text in (b"00", b"01"):
            self.push(text == b"01")
        else:
            self.push(self.number(text.rstrip(b"L")))

    def number(self, text: bytes) -> int:
        if len(text) > _MAX_DIGITS:
            raise self.fail("a number of more than 64 digits")
        try:
            return int(text)
        except ValueError as exc:
            raise self.fail("a malformed number") from exc

    def op_long_bin(self, n: int):
        if n > _MAX_DIGITS:
            raise self.fail("a number of more than 64 bytes")
        self.push(int.from_bytes(self.take(n), "little", signed=True))

    def op_float_text(self):
        try:
            self.push(float(self.line()))
        except ValueError as exc:
            raise self.fail("a malformed float") from exc

    def op_string_text(self):
        text = self.line()
        if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b'"', b"'"):
            raise self.fail("a malformed STRING")
        self.push_text(codecs.escape_decode(text[1:-1])[0], "ascii")

    def push_text(self, raw: bytes, encoding: str, errors: str = "strict"):
        try:
            value = raw.decode(encoding, errors)
        except UnicodeDecodeError as exc:
            raise self.fail("a string that is not valid text") from exc
        self.push(value, COST_SCALAR + len(value))

    def op_global(self, module: str, name: str):
        node = Node("g", ref=self.resolve(module, name))
        self.push(node, COST_NODE)

    def op_stack_global(self):
        name, module = self.pop(), self.pop()
        if type(module) is not str or type(name) is not str:
            raise self.fail("STACK_GLOBAL of something other than two strings")
        self.op_global(module, name)

    def op_call(self, kind: str):
        args, fn = self.pop(), self.pop()
        if type(fn) is not Node or fn.kind != "g":
            raise self.fail("calls something that is not an allowed global")
        if type(args) is not Node or args.kind != "t":
            raise self.fail("calls a global with arguments that are not a tuple")
        node = Node(kind, ref=fn.ref)
        self.spend(COST_NODE)
        self.adopt(node, [fn, args])
        node.args = args
        self.push(node, 0)

    def op_build(self):
        state = self.pop()
        node = self.top_node("rn")
        if node.state is not None:
            raise self.fail("sets the state of an object twice")
        if state is None:
            raise self.fail("sets an empty state")
        self.adopt(node, [state])
        node.state = state

    def op_setitems(self, items: list):
        if len(items) % 2:
            raise self.fail("SETITEMS with an odd number of values")
        self.extend(self.top_node("drn"), items)

    def op_appends(self, items: list):
        self.extend(self.top_node("lrn"), items)

    def op_put(self, index: int):
        if not self.stack:
            raise self.fail("memoizes an empty stack")
        if index == len(self.memo):
            self.spend(COST_REF)
            self.memo.append(self.stack[-1])
        elif 0 <= index < len(self.memo):
            self.memo[index] = self.stack[-1]
        else:
            raise self.fail("memo index out of order")

    def op_get(self, index: int):
        if not 0 <= index < len(self.memo):
            raise self.fail("reads a memo entry never written")
        self.push(self.memo[index], 0)

    def op_mark(self):
        self.spend(COST_REF)
        self.marks.append(len(self.stack))
