"""A bounded pickle interpreter that builds inert nodes, never objects: the first half of reading
DCP's ``.metadata`` (:mod:`cloudckpt.dcp.metadata_build` is the second half, which turns nodes
into DCP's classes after checking each one).

Contract of :func:`parse`:
- It runs the opcodes of protocols 0-5 that plain data needs (numbers, strings, bytes, ``None``,
  booleans, tuples, lists, dicts, the memo, marks, frames) and the object opcodes ``GLOBAL`` /
  ``STACK_GLOBAL``, ``REDUCE``, ``NEWOBJ``, ``BUILD``. Nothing is called and no attribute is set:
  a global is looked up by ``resolve(module, name)`` (which refuses names outside its allow-list)
  and becomes a :class:`~cloudckpt.dcp.pickle_parser.Node` of kind ``"g"``; ``REDUCE`` /
  ``NEWOBJ`` make a node that records
  the global and its arguments; ``BUILD`` records a state on such a node, once, and only on a
  node this parse created with ``REDUCE`` / ``NEWOBJ``, never on a global (a class) and never
  on a node already used inside another one. Tuples, lists and dicts are nodes too: nothing is
  hashed or compared while parsing.
- Sets, persistent ids, extension codes, out-of-band buffers, ``INST`` / ``OBJ`` /
  ``NEWOBJ_EX`` and any unknown opcode are refused. (Objects in protocols 0 and 1, and bytes in
  protocol 2, are pickled through ``copyreg`` / ``_codecs`` globals, which ``resolve`` refuses:
  DCP writes protocol 4 or later.)
- Bounded before anything exists: nesting depth (``max_depth``), the size of the result counted
  as a tree (``max_nodes``: a node reached twice through the memo counts twice, so hashing or
  walking the result later is bounded too), and an estimate of the memory of everything built,
  stack and memo included (``max_cost`` bytes); numbers of more than 64 digits or bytes are
  refused. A node can only contain nodes built before it, so the result has no cycles.
- Any refusal or malformed input raises :class:`~cloudckpt.errors.ManifestError` (``path``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cloudckpt.dcp.pickle_ops import OPS
from cloudckpt.dcp.pickle_parser import Parser


def parse(
    data,
    resolve: Callable[[str, str], Any],
    *,
    where: str,
    max_depth: int,
    max_nodes: int,
    max_cost: int,
):
    """The value a pickle holds, as scalars and :class:`~cloudckpt.dcp.pickle_parser.Node`
    objects (module doc)."""
    return Parser(data, resolve, where, max_depth, max_nodes, max_cost, ops=OPS).run()
