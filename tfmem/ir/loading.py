"""Read a graph from whatever the user has: a ``tf.Graph``, a ``GraphDef``, a ``MetaGraphDef`` or a file.

Files may be binary (``.pb``) or text (``.pbtxt``) protos of a GraphDef or a MetaGraphDef; the content
decides, not the extension.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TypeAlias

import tensorflow as tf
from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from tfmem.errors import BadInputError, MalformedGraphError
from tfmem.ir.graph import GraphIR
from tfmem.ir.shapes import FeedShapes, annotate

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
    if isinstance(source, graph_pb2.GraphDef):
        return source
    if isinstance(source, meta_graph_pb2.MetaGraphDef):
        return source.graph_def
    if isinstance(source, GraphIR):
        return source.to_graph_def()
    if isinstance(source, str | os.PathLike):
        return _read_file(Path(source))
    raise BadInputError(
        f"cannot read a graph from a {type(source).__name__}; pass a tf.Graph, GraphDef, MetaGraphDef or a "
        ".pb/.pbtxt path"
    )


def load(source: GraphSource, feed_shapes: FeedShapes | None = None) -> GraphIR:
    """Load ``source`` and annotate every output with dtype, shape and bytes (see ``tfmem.ir.shapes.annotate``).

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     _ = tf.zeros((256, 256), name="z")
    >>> load(g).spec("z:0").nbytes
    262144
    """
    return annotate(to_graph_def(source), feed_shapes)


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
