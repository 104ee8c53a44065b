"""DCP's metadata objects built from the inert nodes of :mod:`cloudckpt.dcp.unpickle`: the
second half of reading a ``.metadata``.

Contract:
- :func:`resolve` is the allow-list of globals: DCP's metadata classes (``Metadata``,
  ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the memory-format enum),
  ``filesystem._StorageInfo``, ``torch.Size``, torch dtypes and layouts (``torch.strided`` is
  pickled through ``torch.serialization._get_layout``), ``collections.OrderedDict`` and
  ``pathlib`` paths. Any other name raises :class:`~cloudckpt.errors.ManifestError` naming it.
- :func:`build` makes each object itself, through its class's own constructor, from fields it
  checked first: a dataclass from a ``NEWOBJ`` without arguments and a ``BUILD`` whose state
  names only fields the dataclass declares, each of its declared type (missing ones take their
  defaults; a missing field without one is refused); ``torch.Size`` from one tuple of at most
  ``MAX_NDIM`` whole numbers; a layout, an enum member, an ``OrderedDict`` or a path from the
  arguments their own pickling uses. Nothing is ever set on an object it did not just make, nor
  on any class. A dict key that cannot be hashed is refused. Every refusal is a
  ``ManifestError`` naming the class or field.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib

import torch
from torch.distributed.checkpoint import metadata as _md

from cloudckpt.dcp.pickle_parser import FIX as _FIX
from cloudckpt.dcp.pickle_parser import Node
from cloudckpt.errors import ManifestError
from cloudckpt.statedict.torch_private import storage_info_class

_StorageInfo = storage_info_class()

#: Most dimensions of a tensor, a chunk box or an index offset in a ``.metadata``.
MAX_NDIM = 64

_WHERE = ".metadata"


def _fail(why: str, where: str = "") -> ManifestError:
    return ManifestError(f"{why}: not unpickled ({_FIX})", path=f"{_WHERE} {where}".rstrip())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(check):
    return lambda v: v is None or check(v)


def _ints(v) -> bool:
    return isinstance(v, (tuple, list)) and all(_is_int(x) for x in v)


def _strs(v) -> bool:
    return isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v)


def _is(*types):
    return lambda v: isinstance(v, types)


def _any(v) -> bool:
    return True


_PATHS = {
    (module, name): getattr(pathlib, name)
    for module in ("pathlib", "pathlib._local")
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
}
_SIZE = _is(torch.Size)
_BOX = lambda v: isinstance(v, torch.Size) or _ints(v)  # noqa: E731
#: The fields of each dataclass a ``.metadata`` holds, and the check each value must pass.
_FIELDS = {
    _md.Metadata: {
        "state_dict_metadata": _is(dict),
        "planner_data": _any,
        "storage_data": _any,
        "storage_meta": _opt(_is(_md.StorageMeta)),
        "version": _opt(_is(str)),
    },
    _md.TensorStorageMetadata: {
        "properties": _is(_md.TensorProperties),
        "size": _SIZE,
        "chunks": _is(list),
    },
    _md.BytesStorageMetadata: {},
    _md.TensorProperties: {},  # pickled as a tuple of its fields: see _Builder.properties
    _md.ChunkStorageMetadata: {"offsets": _BOX, "sizes": _BOX},
    _md.MetadataIndex: {"fqn": _is(str), "offset": _opt(_BOX), "index": _opt(_is_int)},
    _md.StorageMeta: {
        "checkpoint_id": _opt(_is(str, os.PathLike)),
        "save_id": _opt(_is(str)),
        "load_id": _opt(_is(str)),
        "modules": _strs,
    },
    _StorageInfo: {
        "relative_path": _is(str),
        "offset": _is_int,
        "length": _is_int,
        "transform_descriptors": _opt(_strs),
    },
}
_NAMES = {(cls.__module__, cls.__name__): cls for cls in _FIELDS}
_CALLS = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): "layout",
    (_md.__name__, "_MEM_FORMAT_ENCODING"): _md._MEM_FORMAT_ENCODING,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_PATHS,
}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {
    _md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _md._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    _md._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


def resolve(module: str, name: str):
    """What global ``module.name`` of a ``.metadata`` stands for (module doc)."""
    key = (module, name)
    found = _NAMES.get(key, _CALLS.get(key))
    if found is not None:
        return found
    # vars(), not getattr(): torch's module __getattr__ imports submodules by name
    found = vars(torch).get(name) if module == "torch" else None
    if isinstance(found, (torch.dtype, torch.layout)):
        return found
    raise ManifestError(
        f"refers to {module}.{name}, which DCP metadata never holds: not unpickled ({_FIX})",
        path=_WHERE,
    )


class _Builder:
    def __init__(self) -> None:
        self.done: dict[int, object] = {}  # id(node) -> the object built for it

    def build(self, value):
        if type(value) is not Node:
            return value
        out = self.done.get(id(value), self)
        if out is self:
            out = self.done[id(value)] = self.make(value)
        return out

    def make(self, node: Node):
        kind = node.kind
        if kind == "t":
            return tuple(self.build(v) for v in node.items)
        if kind == "l":
            return [self.build(v) for v in node.items]
        if kind == "d":
            return self.pairs(node.items, {})
        if kind == "g":
            return node.ref
        target = node.ref
        args = self.build(node.args)
        if target in _FIELDS:
            if kind != "n" or args or node.items:
                raise _fail(f"{target.__name__} not made as pickle makes a dataclass")
            return self.dataclass(target, node.state)
        if (
            kind != "r"
            or node.state is not None
            or (node.items and target is not collections.OrderedDict)
        ):
            raise _fail(f"{getattr(target, '__name__', target)} not made as pickle makes it")
        return self.call(target, args, node.items)

    def pairs(self, items: list, out: dict) -> dict:
        for i in range(0, len(items), 2):
            key = self.build(items[i])
            try:
                hash(key)
            except TypeError as exc:
                raise _fail(
                    f"a dict key of type {type(key).__name__}, which cannot be one"
                ) from exc
            out[key] = self.build(items[i + 1])
        return out

    def call(self, target, args: tuple, items: list):
        name = getattr(target, "__name__", str(target))
        if target is torch.Size:
            if len(args) != 1 or not _ints(args[0]) or len(args[0]) > MAX_NDIM:
                raise _fail(f"a torch.Size of other than at most {MAX_NDIM} whole numbers")
            return torch.Size(args[0])
        if target == "layout":
            if len(args) != 1 or args[0] not in _LAYOUTS:
                raise _fail(f"an unknown layout {args[:1]!r:.80}")
            return _LAYOUTS[args[0]]
        if target is _md._MEM_FORMAT_ENCODING:
            if len(args) != 1 or not _is_int(args[0]) or args[0] not in {e.value for e in target}:
                raise _fail(f"an unknown memory format {args[:1]!r:.80}")
            return target(args[0])
        if target is collections.OrderedDict:
            if args:
                raise _fail("an OrderedDict made with arguments")
            return self.pairs(items, collections.OrderedDict())
        if len(args) > 4096 or not _strs(args):  # a pathlib path: its parts
            raise _fail(f"a {name} of other than strings")
        try:
            return target(*args)
        except Exception as exc:  # a WindowsPath on POSIX, say
            raise _fail(f"a {name} this system cannot make ({type(exc).__name__})") from exc

    def dataclass(self, cls, state_node):
        name = cls.__name__
        checks = _FIELDS[cls]
        if cls is _md.TensorProperties:
            return self.properties(self.build(state_node))
        state = {} if state_node is None else self.build(state_node)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _fail(f"{name} with a state that is not a dict of field names")
        unknown = sorted(set(state) - set(checks))
        if unknown:
            raise _fail(
                f"{name} with fields {unknown[:5]!r:.120} it does not declare (written "
                "by another torch version?)"
            )
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in state:
                value = state[f.name]
                if not checks[f.name](value):
                    raise _fail(f"a {type(value).__name__} where {name}.{f.name} has another type")
                kwargs[f.name] = value
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(f"{name} without its field {f.name!r}")
        return cls(**kwargs)

    def properties(self, state):
        if not (isinstance(state, tuple) and len(state) == 5):
            raise _fail("TensorProperties with a state that is not its 5 fields")
        dtype, layout, requires_grad, encoding, pin_memory = state
        if (
            not isinstance(dtype, torch.dtype)
            or not isinstance(layout, torch.layout)
            or not isinstance(requires_grad, bool)
            or not isinstance(pin_memory, bool)
            or encoding not in _MEMORY_FORMATS
        ):
            raise _fail("TensorProperties with fields of other types than DCP writes")
        return _md.TensorProperties(
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            memory_format=_MEMORY_FORMATS[encoding],
            pin_memory=pin_memory,
        )


def build(value):
    """The objects ``value`` (a parse result) stands for (module doc)."""
    return _Builder().build(value)
