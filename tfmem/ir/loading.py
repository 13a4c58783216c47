"""Read a graph from whatever the user has: a ``tf.Graph``, a ``GraphDef``, a ``MetaGraphDef`` or a file.

Files may be binary (``.pb``) or text (``.pbtxt``) protos of a GraphDef or a MetaGraphDef; the content
decides, not the extension.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import tensorflow as tf
from google.protobuf import message, text_format
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import op_def_registry

from tfmem.errors import BadInputError, MalformedGraphError
from tfmem.ir.devices import device_parse_error
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.shapes import MAX_ELEMENTS, MAX_RANK, FeedShapes, annotate

GraphSource: TypeAlias = tf.Graph | graph_pb2.GraphDef | meta_graph_pb2.MetaGraphDef | GraphIR | str | os.PathLike[str]


def to_graph_def(source: GraphSource) -> graph_pb2.GraphDef:
    """Return the ``GraphDef`` of any supported graph source.

    Raises
    ------
    BadInputError
        For a path that does not exist or is not a file, or an unsupported type.
    MalformedGraphError
        For a file that is neither a GraphDef nor a MetaGraphDef.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     _ = tf.constant(1.0, name="c")
    >>> [n.name for n in to_graph_def(g).node]
    ['c']
    """
    if isinstance(source, tf.Graph):
        return source.as_graph_def()
    if isinstance(source, GraphIR):
        return source.to_graph_def()
    if isinstance(source, graph_pb2.GraphDef):
        gd = source
    elif isinstance(source, meta_graph_pb2.MetaGraphDef):
        gd = source.graph_def
    elif isinstance(source, str | os.PathLike):
        gd = _read_file(Path(source))
    else:
        raise BadInputError(
            f"cannot read a graph from a {type(source).__name__}; pass a tf.Graph, GraphDef, MetaGraphDef or a "
            ".pb/.pbtxt path"
        )
    check_node_defs(gd)
    return gd


def check_node_defs(gd: graph_pb2.GraphDef) -> None:
    """Raise ``MalformedGraphError`` for the first node TensorFlow would refuse to import.

    Checks what Grappler's C++ code takes for granted and may abort the process on (a ``Const`` without its
    ``value``): every node has a unique name, a device string that parses, inputs that name nodes of the graph,
    an op that is registered or a library function, the attrs its op requires with the right kinds and valid
    dtypes and shapes, and its op's number of data inputs, before any control input. A ``tf.Graph`` was checked
    by TensorFlow as it was built; GraphDefs from files or other programs were not.

    Examples
    --------
    >>> from tensorflow.core.framework import graph_pb2
    >>> gd = graph_pb2.GraphDef()
    >>> gd.node.add(name="c", op="Const")  # doctest: +ELLIPSIS
    name: "c"...
    >>> check_node_defs(gd)
    Traceback (most recent call last):
    ...
    tfmem.errors.MalformedGraphError: node 'c' (Const) has no attr 'value', which its op requires; export the graph again with tf.io.write_graph
    """
    functions = {f.signature.name for f in gd.library.function}
    names: set[str] = set()
    for i, nd in enumerate(gd.node):
        if not nd.name:
            raise MalformedGraphError(f"node {i} of the graph ({nd.op or 'no op type'}) has no name; every node "
                                      "needs a unique name")
        if nd.name in names:
            raise MalformedGraphError(f"duplicate node name {nd.name!r}; node names must be unique")
        names.add(nd.name)
        problem = _node_def_problem(nd, functions)
        if problem:
            raise MalformedGraphError(f"node {nd.name!r} ({nd.op}) {problem}; export the graph again with "
                                      "tf.io.write_graph")
    for nd in gd.node:
        for raw in nd.input:
            pred = TensorRef.parse(raw[1:] if raw.startswith("^") else raw).node
            if pred not in names:
                raise MalformedGraphError(f"node {nd.name!r} ({nd.op}) has input {pred!r}, which is not a node of the "
                                          "graph")


_ATTR_KIND = {"type": "type", "int": "i", "string": "s", "float": "f", "bool": "b", "shape": "shape",
              "tensor": "tensor", "func": "func"}
# Attrs TensorFlow adds itself, that no OpDef declares, with the types tfmem and TensorFlow read them as.
_INTERNAL_ATTRS = {"_class": "list(string)", "_output_shapes": "list(shape)"}
_VALID_DTYPES = frozenset(v for v in types_pb2.DataType.values() if v != types_pb2.DT_INVALID)


@dataclass(frozen=True)
class _OpSpec:
    """What ``_node_def_problem`` checks a node of one op type against, read once from its OpDef."""

    attrs: tuple[tuple[str, str, bool, frozenset[int]], ...]   # name, type, has a default, allowed dtypes
    declared: frozenset[str]
    inputs: tuple[tuple[str, str], ...]                          # (number_attr, type_list_attr) per input arg


_OP_SPECS: dict[str, _OpSpec] = {}  # ops not registered are not kept: a library loaded later may register them


def _op_spec(op: str) -> _OpSpec | None:
    spec = _OP_SPECS.get(op)
    if spec is None:
        op_def = op_def_registry.get(op)
        if op_def is None:
            return None
        attrs = tuple((a.name, a.type, a.HasField("default_value"), frozenset(a.allowed_values.list.type))
                      for a in op_def.attr)
        spec = _OP_SPECS[op] = _OpSpec(attrs, frozenset(a[0] for a in attrs),
                                       tuple((arg.number_attr, arg.type_list_attr) for arg in op_def.input_arg))
    return spec


def _node_def_problem(nd: node_def_pb2.NodeDef, functions: set[str]) -> str:
    """What is wrong with one NodeDef ("" when nothing is)."""
    inputs = list(nd.input)
    given = len(inputs)
    for i, name in enumerate(inputs):
        if name.startswith("^"):
            given = i
            if any(not later.startswith("^") for later in inputs[i:]):
                return "has a data input after a control input; data inputs come first"
            break
    if nd.device and device_parse_error(nd.device):
        return f"has device {nd.device!r}, which is not a device string ({device_parse_error(nd.device)})"
    if nd.op in functions:
        return ""
    spec = _op_spec(nd.op)
    if spec is None:
        return f"has op type {nd.op!r}, which TensorFlow {tf.__version__} does not register"
    attr = nd.attr
    for name, kind, has_default, allowed in spec.attrs:
        if name not in attr:
            if has_default:
                continue
            return f"has no attr {name!r}, which its op requires"
        problem = _attr_problem(kind, attr[name], allowed)
        if problem:
            return f"has attr {name!r} {problem}"
    for name in attr:
        if name not in spec.declared:
            value = attr[name]
            kind = _INTERNAL_ATTRS.get(name) or value.WhichOneof("value") or ""
            problem = _attr_problem(kind, value, frozenset()) if kind in ("shape", "tensor", *_INTERNAL_ATTRS.values()) else ""
            if problem:
                return f"has attr {name!r} {problem}"
    expected = 0
    for number_attr, type_list_attr in spec.inputs:
        if number_attr:
            expected += attr[number_attr].i if number_attr in attr else 0
        elif type_list_attr:
            expected += len(attr[type_list_attr].list.type) if type_list_attr in attr else 0
        else:
            expected += 1
    if given != expected:
        return f"has {given} data input(s), but its op takes {expected}"
    return ""


def _attr_problem(kind: str, value: attr_value_pb2.AttrValue, allowed: frozenset[int]) -> str:
    """What is wrong with an attr value meant to be of OpDef attr type ``kind`` ("" when nothing is)."""
    is_list = kind.startswith("list(")
    base = kind[5:-1] if is_list else kind
    field = value.WhichOneof("value")
    want = "list" if is_list else _ATTR_KIND.get(base)
    if want is None or (field is None and is_list):  # placeholders ('func' lists, ...) and empty lists
        return ""
    if field != want:
        return f"holds {field or 'nothing'}, but its op wants a {kind}"
    if base == "type":
        types = list(value.list.type) if is_list else [value.type]
        bad = [t for t in types if t not in _VALID_DTYPES]
        if bad:
            return f"has dtype {bad[0]}, which is no TensorFlow dtype"
        if allowed and any(t not in allowed for t in types):
            return f"has a dtype its op does not allow ({', '.join(str(t) for t in types if t not in allowed)})"
    elif base == "shape":
        for shape in list(value.list.shape) if is_list else [value.shape]:
            problem = _shape_problem(shape, partial=True)
            if problem:
                return problem
    elif base == "tensor":
        for tensor in list(value.list.tensor) if is_list else [value.tensor]:
            if tensor.dtype not in _VALID_DTYPES:
                return f"holds a tensor of dtype {tensor.dtype}, which is no TensorFlow dtype"
            problem = _shape_problem(tensor.tensor_shape, partial=False)
            if problem:
                return problem
    return ""


def _shape_problem(shape: tensor_shape_pb2.TensorShapeProto, partial: bool) -> str:
    """What is wrong with a shape ("" when nothing is); only a ``partial`` one (an attr, not a tensor's) may have
    unknown dimensions (-1) or an unknown rank."""
    if not partial and shape.unknown_rank:
        return "holds a tensor of unknown rank"
    count = 1
    for d in shape.dim:
        if d.size < (-1 if partial else 0):
            return f"has a shape with dimension {d.size}" + (" (only -1, unknown, may be negative)" if partial else "")
        count *= max(d.size, 1)
    if count > MAX_ELEMENTS:
        return "has a shape of more than 2**62 elements"
    if len(shape.dim) > MAX_RANK:
        return f"has a shape of {len(shape.dim)} dimensions (at most {MAX_RANK})"
    return ""


def load(source: GraphSource, feed_shapes: FeedShapes | None = None) -> GraphIR:
    """Load ``source`` and annotate every output with dtype, shape and bytes (see ``tfmem.ir.shapes.annotate``).

    Raises
    ------
    BadInputError
        For a missing file, a source of another type, or malformed ``feed_shapes``.
    MalformedGraphError
        For a graph TensorFlow would not import (checked for GraphDefs, MetaGraphDefs and files).

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     _ = tf.zeros((256, 256), name="z")
    >>> load(g).spec("z:0").nbytes
    262144
    """
    # A tf.Graph was built by TensorFlow, a GraphIR loaded through here: both import. Other graphs may not.
    return annotate(to_graph_def(source), feed_shapes, check_import=not isinstance(source, tf.Graph | GraphIR))



def _read_file(path: Path) -> graph_pb2.GraphDef:
    if not path.exists():
        raise BadInputError(f"graph file {str(path)!r} does not exist")
    if not path.is_file():
        raise BadInputError(f"{str(path)!r} is not a file; give the path of a .pb or .pbtxt graph")
    data = path.read_bytes()
    for parse in (_parse_binary, _parse_text):
        gd = parse(data)
        if gd is not None:
            return gd
    raise MalformedGraphError(
        f"{str(path)!r} is not a TensorFlow graph: it parses as neither a GraphDef nor a MetaGraphDef "
        "(binary .pb or text .pbtxt); export one with tf.io.write_graph"
    )


_OP_TYPE = re.compile(r"^[A-Za-z_][A-Za-z0-9_>]*$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")


def _looks_like_graph(gd: graph_pb2.GraphDef) -> bool:
    # Binary protos of one type often parse "successfully" as another; real graphs have TF-style names.
    return len(gd.node) > 0 and all(_OP_TYPE.match(n.op) and _NODE_NAME.match(n.name) for n in gd.node)


def _parse_binary(data: bytes) -> graph_pb2.GraphDef | None:
    gd = graph_pb2.GraphDef()
    try:
        gd.ParseFromString(data)
        if _looks_like_graph(gd):
            return gd
    except message.DecodeError:
        pass
    meta = meta_graph_pb2.MetaGraphDef()
    try:
        meta.ParseFromString(data)
    except message.DecodeError:
        return None
    return meta.graph_def if _looks_like_graph(meta.graph_def) else None


def _parse_text(data: bytes) -> graph_pb2.GraphDef | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    for proto_type in (graph_pb2.GraphDef, meta_graph_pb2.MetaGraphDef):
        proto = proto_type()
        try:
            text_format.Parse(text, proto)
        except text_format.ParseError:
            continue
        gd = proto.graph_def if isinstance(proto, meta_graph_pb2.MetaGraphDef) else proto
        if _looks_like_graph(gd):
            return gd
    return None
