"""Tensor specs for every output: dtype, shape and bytes, from TensorFlow's own shape inference.

The GraphDef is imported into a scratch ``tf.Graph``; fed tensors named in ``feed_shapes`` are replaced
through ``input_map`` by placeholders of the given shape, so their sizes propagate downstream exactly as
TensorFlow would propagate them. Tensors whose size is still unknown keep ``nbytes=None``; the simulator
raises ``UnknownShapeError`` listing all of those it needs (``require_known``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import SupportsIndex

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.grappler import item as gitem

from tfmem.errors import BadInputError, MalformedGraphError, UnknownShapeError, first_line
from tfmem.ir.editor import claim_name
from tfmem.ir.graph import GraphIR, OpNode, TensorRef, TensorSpec
from tfmem.ir.ops import FEEDABLE_OPS
from tfmem.ir.static_values import complete_shapes

FeedShapes = Mapping[str, Sequence[int]]

# Bytes per element of dtypes whose size TensorFlow does not report as a fixed width.
STRING_ELEMENT_BYTES = 32  # sizeof(tstring) on 64-bit Linux; the characters themselves are not counted
HANDLE_DTYPES = frozenset({"resource", "variant"})


def dtype_size(dtype: tf.DType) -> int:
    """Bytes per element of ``dtype`` (0 for resource/variant handles, 32 for strings)."""
    if dtype.name in HANDLE_DTYPES:
        return 0
    if dtype == tf.string:
        return STRING_ELEMENT_BYTES
    return int(dtype.size)


def spec_of(dtype: tf.DType, shape: tf.TensorShape) -> TensorSpec:
    """The ``TensorSpec`` of a tensor of ``dtype`` and ``shape`` (``nbytes`` None when the shape is partial)."""
    base = dtype.base_dtype
    if shape.rank is None:
        dims: tuple[int | None, ...] | None = None
    else:  # Grappler writes unknown dimensions as negative symbolic ids
        dims = tuple(None if d is None or d < 0 else d for d in shape.as_list())
    if base.name in HANDLE_DTYPES:
        return TensorSpec(base.name, dims, 0)
    if dims is None or any(d is None for d in dims):
        return TensorSpec(base.name, dims, None)
    count = 1
    for d in dims:
        count *= int(d)  # type: ignore[arg-type]
    return TensorSpec(base.name, dims, count * dtype_size(base))


# The most elements one fed tensor may have: more would be more memory than any machine has (tfmem.units.MAX_BYTES).
MAX_ELEMENTS = 2**62
MAX_RANK = 254  # TensorShape's limit (TensorShapeRep::MaxDimensions)
_FEED_EXAMPLE = "feed_shapes={'x:0': (64, 784)}"


def check_feed_shapes(feed_shapes: object) -> dict[str, tuple[int, ...]]:
    """Return ``feed_shapes`` as ``{"node:index": (d1, d2, ...)}``; raise ``BadInputError`` if it is not one.

    A key is a tensor name (``"x:0"``, or ``"x"`` for output 0) or anything with such a ``name`` (a
    ``tf.Tensor``); a value is a full shape: a sequence of non-negative ints (``()`` for a scalar).

    Examples
    --------
    >>> check_feed_shapes({"x": [64, 784]})
    {'x:0': (64, 784)}
    >>> check_feed_shapes({"x:0": (64, -3)})
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: feed_shapes['x:0'] = (64, -3): dimension 1 is -3, which is negative; give the full shape of the fed tensor, e.g. feed_shapes={'x:0': (64, 784)}
    """
    if feed_shapes is None:
        return {}
    if not isinstance(feed_shapes, Mapping):
        raise BadInputError(f"feed_shapes must be a dict of tensor name to shape, e.g. {_FEED_EXAMPLE}; got "
                            f"{feed_shapes!r} ({type(feed_shapes).__name__})")
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in feed_shapes.items():
        name = getattr(key, "name", key)  # a tf.Tensor stands for its name, as in a session's feed dict
        if not isinstance(name, str) or not name.strip(":"):
            raise BadInputError(f"feed_shapes key {key!r} is not a tensor name; key each shape by a name such as "
                                f"'x:0', e.g. {_FEED_EXAMPLE}")
        ref = str(TensorRef.parse(name))
        out[ref] = _full_shape(ref, shape)
    return out


def _full_shape(name: str, shape: object) -> tuple[int, ...]:
    where = f"feed_shapes[{name!r}] = {shape!r}"
    fix = f"give the full shape of the fed tensor, e.g. {_FEED_EXAMPLE}"
    if isinstance(shape, str | bytes) or not isinstance(shape, Iterable):
        raise BadInputError(f"{where} is not a shape; {fix}")
    dims, problem = _checked_dims(list(shape))
    if problem:
        raise BadInputError(f"{where}: {problem}; {fix}")
    return dims


def _checked_dims(dims: Sequence[object]) -> tuple[tuple[int, ...], str]:
    """``dims`` as ints, and what is wrong with them ("" when nothing is)."""
    out: list[int] = []
    count = 1
    for i, d in enumerate(dims):
        if isinstance(d, bool) or not isinstance(d, SupportsIndex):  # ints and numpy ints; not floats or None
            unknown = " (a fed tensor's shape is fully known)" if d is None else ""
            return (), f"dimension {i} is {d!r}, not an int{unknown}"
        dim = operator.index(d)
        if dim < 0:
            return (), f"dimension {i} is {dim}, which is negative"
        out.append(dim)
        count *= dim
        if dim > MAX_ELEMENTS or count > MAX_ELEMENTS:
            return (), "it has more than 2**62 elements, more than any machine holds"
    if len(out) > MAX_RANK:
        return (), f"it has {len(out)} dimensions; TensorFlow allows at most {MAX_RANK}"
    return tuple(out), ""


def parse_feed_shapes(items: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Parse CLI-style ``"x:0=32,784"`` strings into ``{"x:0": (32, 784)}`` (``"x:0="``: a scalar).

    >>> parse_feed_shapes(["x:0=32,784", "y=8"])
    {'x:0': (32, 784), 'y:0': (8,)}
    >>> parse_feed_shapes(["x:0=32,-1"])
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: feed shape 'x:0=32,-1' is malformed (dimension 1 is -1, which is negative); write NAME=D1,D2,... e.g. x:0=32,784 (a scalar: x:0=)
    """
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        dims: list[object] = []
        for part in text.split(",") if text.strip() else []:
            try:
                dims.append(int(part))
            except ValueError:
                dims.append(part.strip())
        shape, problem = _checked_dims(dims)
        if not sep:
            problem = "no '='"
        elif not name.strip(":"):
            problem = "no tensor name before '='"
        if problem:
            raise BadInputError(
                f"feed shape {item!r} is malformed ({problem}); write NAME=D1,D2,... e.g. x:0=32,784 (a scalar: x:0=)"
            )
        out[str(TensorRef.parse(name))] = shape
    return out


def annotate(gd: graph_pb2.GraphDef, feed_shapes: FeedShapes | None = None, *, check_import: bool = False) -> GraphIR:
    """Return the ``GraphIR`` of ``gd`` with a ``TensorSpec`` on every output.

    Parameters
    ----------
    gd : GraphDef
    feed_shapes : mapping of tensor name (``"x:0"`` or ``"x"``) to a full shape
        Fills unknown dimensions, e.g. the batch dimension of a placeholder.
    check_import : first check that TensorFlow imports ``gd`` with the feeds' shapes, for graphs TensorFlow did not
        build: Grappler's shape inference, asked first, passes over graphs it would refuse (shapes that
        contradict each other, inputs of the wrong dtype), which would fail later, where the optimized graph is
        imported

    Raises
    ------
    MalformedGraphError
        When TensorFlow cannot import the graph (unknown ops, bad inputs).
    BadInputError
        When a feed names a missing tensor or a shape incompatible with the graph's static shape.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (None, 10), name="x")
    ...     y = tf.nn.relu(x, name="y")
    >>> annotate(g.as_graph_def(), {"x:0": (32, 10)}).spec("y:0").nbytes
    1280
    """
    feeds = {TensorRef.parse(k): v for k, v in check_feed_shapes(feed_shapes).items()}
    base = GraphIR.from_graph_def(gd)
    imported = None
    if check_import:
        for ref, shape in feeds.items():  # a misfit placeholder's message says which shape fits
            node = base.by_name.get(ref.node)
            if node is not None and node.op in FEEDABLE_OPS and ref.index == 0 and "shape" in node.attrs:
                declared = tf.TensorShape(node.attrs["shape"].shape)
                if not declared.is_compatible_with(tf.TensorShape(shape)):
                    raise _misfit(str(ref), shape, declared)
        # raises MalformedGraphError, or BadInputError for misfit feeds; kept for the slow path below
        imported = _import_with_feeds(base, gd, feeds)
    fast = _specs_from_grappler(base, gd, feeds)
    if fast is not None and all(s.known for specs in fast.values() for s in specs):
        return base.replace_nodes(tuple(_with_outputs(n, fast[n.name]) for n in base.nodes), annotated=True)
    # Grappler's static inference evaluates no shape-computing subgraph (a Range over a Rank, the strided slices
    # of a gather's gradient under op determinism), which importing does: take what each knows, then ask
    # TensorFlow again where both stop short (tests/test_loops.py).
    graph = imported if imported is not None else _import_with_feeds(base, gd, feeds)
    for ref, shape in feeds.items():
        declared = graph.get_operation_by_name(ref.node).outputs[ref.index].shape
        if not declared.is_compatible_with(tf.TensorShape(shape)):
            raise _misfit(str(ref), shape, declared)
    ir, refined = _merged(base, graph, feeds, fast)
    if all(s.known for n in ir.nodes for s in n.outputs):
        return ir
    done = complete_shapes(ir, {TensorRef(n.name, i): _shape(s) for n in ir.nodes for i, s in enumerate(n.outputs)},
                           refined=refined, fed=feeds)
    return ir.replace_nodes(tuple(
        _with_outputs(n, tuple(spec_of(tf.as_dtype(s.dtype), done[TensorRef(n.name, i)])
                               for i, s in enumerate(n.outputs))) for n in ir.nodes))


def _merged(base: GraphIR, graph: tf.Graph, feeds: dict[TensorRef, tuple[int, ...]],
            fast: dict[str, tuple[TensorSpec, ...]] | None) -> tuple[GraphIR, list[TensorRef]]:
    """``base`` with the specs of the imported ``graph`` (a fed tensor: its feed's shape), merged with Grappler's
    (``fast``) where it has them; and the tensors where Grappler's said more than the import's."""
    nodes = []
    refined = []
    for node in base.nodes:
        op = graph.get_operation_by_name(node.name)
        specs = []
        for i, t in enumerate(op.outputs):
            ref = TensorRef(node.name, i)
            shape = tf.TensorShape(feeds[ref]) if ref in feeds else t.shape
            if fast is not None and shape.is_compatible_with(_shape(fast[node.name][i])):
                merged = shape.merge_with(_shape(fast[node.name][i]))
                if merged.as_proto() != shape.as_proto():
                    refined.append(ref)
                shape = merged
            specs.append(spec_of(t.dtype, shape))
        nodes.append(_with_outputs(node, tuple(specs)))
    return base.replace_nodes(tuple(nodes), annotated=True), refined


def _shape(spec: TensorSpec) -> tf.TensorShape:
    return tf.TensorShape(None if spec.shape is None else list(spec.shape))


def _specs_from_grappler(
    base: GraphIR, gd: graph_pb2.GraphDef, feeds: dict[TensorRef, tuple[int, ...]]
) -> dict[str, tuple[TensorSpec, ...]] | None:
    """Specs from Grappler's C++ shape inference: ~4x faster than importing into a Python ``tf.Graph``.

    Only for feeds of placeholders (their ``shape`` attr is set to the fed shape); returns None when it
    cannot answer for every node, and the caller takes the import path, which also reports errors well.
    """
    if any(ref.index != 0 or ref.node not in base or base[ref.node].op not in FEEDABLE_OPS for ref in feeds):
        return None
    patched = graph_pb2.GraphDef()
    patched.CopyFrom(gd)
    names = {node.name for node in gd.node}
    defaults = []
    for node in patched.node:
        if node.op not in FEEDABLE_OPS:
            continue
        declared = tf.TensorShape(node.attr["shape"].shape) if "shape" in node.attr else tf.TensorShape(None)
        shape = feeds.get(TensorRef(node.name, 0))
        if shape is not None and not declared.is_compatible_with(tf.TensorShape(shape)):
            raise _misfit(f"{node.name}:0", shape, declared)
        full = tf.TensorShape(shape) if shape is not None else declared
        if not full.is_fully_defined():  # Grappler would drop even the known dimensions: import instead
            return None
        defaults.append(as_shape_only_feed(node, full, names))
    patched.node.extend(defaults)
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(patched)
    meta.collection_def["train_op"].node_list.value.extend(n.name for n in patched.node)
    try:
        props = gitem.Item(meta, ignore_colocation=True).GetOpProperties()
    except Exception:  # unknown ops, bad graphs: let the import path say what is wrong
        return None
    out: dict[str, tuple[TensorSpec, ...]] = {}
    for node in base.nodes:
        if node.name not in props:
            return None
        out[node.name] = tuple(
            spec_of(tf.as_dtype(p.dtype), tf.TensorShape(p.shape)) for p in props[node.name]
        )
    return out


def _misfit(name: str, shape: tuple[int, ...], declared: tf.TensorShape) -> BadInputError:
    """The error for a feed shape its placeholder's declared shape rules out, with a shape that fits."""
    fix = ""
    if declared.rank is not None:  # unknown dimensions shown as the given one where it has one, else 64
        dims = [d if d is not None else (shape[i] if i < len(shape) else 64) for i, d in enumerate(declared.as_list())]
        example = "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
        fix = (f"; give a shape that fits it, e.g. feed_shapes={{{name!r}: {example}}} "
               f"(CLI: --feed-shape {name}={','.join(map(str, dims))})")
    return BadInputError(f"feed_shapes gives {name} the shape {shape}, which does not fit its declared shape "
                         f"{declared}{fix}")


def as_shape_only_feed(node: node_def_pb2.NodeDef, shape: tf.TensorShape, names: set[str]) -> node_def_pb2.NodeDef:
    """Turn the placeholder ``node`` into a ``PlaceholderWithDefault`` of ``shape``; return the default it reads.

    Grappler's inference takes a placeholder for a feed of unknown shape, so its shape must be stated another
    way. The default is a data-less ``Const`` of that shape (this copy is never run). A ``Const`` in the
    placeholder's place would state its value too: Grappler folds shape arithmetic on constants, and reads a
    data-less one as zeros, so ``zeros(stack([n, 4]))`` of an int placeholder ``n`` came out ``(0, 4)``, 0 bytes.
    Grappler evaluates nothing through a ``PlaceholderWithDefault``: what depends on the fed value stays unknown.
    """
    dtype = node.attr["dtype"].type
    default = node_def_pb2.NodeDef(name=claim_name(names, f"{node.name}/tfmem_shape_only"), op="Const")
    default.attr["dtype"].type = dtype
    default.attr["value"].tensor.dtype = dtype
    default.attr["value"].tensor.tensor_shape.CopyFrom(shape.as_proto())
    del node.input[:]
    node.op = "PlaceholderWithDefault"
    node.attr.clear()
    node.attr["dtype"].type = dtype
    node.attr["shape"].shape.CopyFrom(shape.as_proto())
    node.input.append(default.name)
    return default


def _with_outputs(node: OpNode, outputs: tuple[TensorSpec, ...]) -> OpNode:
    return OpNode(node.name, node.op, node.inputs, node.control_inputs, node.device, outputs, node.attrs, node.proto)


def _import_with_feeds(base: GraphIR, gd: graph_pb2.GraphDef, feeds: dict[TensorRef, tuple[int, ...]]) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        input_map: dict[str, tf.Tensor] = {}
        for ref, shape in feeds.items():
            node = base.by_name.get(ref.node)
            if node is None:
                raise BadInputError(f"feed_shapes names {ref}, but the graph has no node {ref.node!r}")
            dtype = _output_dtype(node, ref.index)
            input_map[str(ref)] = tf.compat.v1.placeholder(dtype, shape, name=f"tfmem_feed_{len(input_map)}")
        try:
            tf.graph_util.import_graph_def(_for_shape_inference(gd), input_map=input_map or None, name="")
        except ValueError as e:  # the feeds are at fault only if the graph imports without them
            raise _import_error(e, feeds if input_map and _imports(gd) else {}) from None
        except Exception as e:  # e.g. NotFoundError for ops not registered in this build of TensorFlow
            raise MalformedGraphError(f"TensorFlow cannot import the graph: {first_line(e)}") from None
    return graph


def _for_shape_inference(gd: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """``gd`` with Grappler's ``_FusedBatchNormEx`` (batch norm + activation, fused by the remapper) imported as
    the ``FusedBatchNormV3`` it replaced, whose outputs have the same shapes: its shape function refuses a channel
    count not divisible by 4 (a cuDNN limit) that the session's own graph conversion does not enforce on CPU
    (tf_keras NASNetMobile has 11 channels;
    tests/test_memsim.py::test_a_fused_batch_norm_with_odd_channels_simulates_after_grappler)."""
    if not any(n.op == "_FusedBatchNormEx" for n in gd.node):
        return gd
    out = graph_pb2.GraphDef()
    out.CopyFrom(gd)
    for node in out.node:
        if node.op == "_FusedBatchNormEx":
            node.op = "FusedBatchNormV3"
            data_inputs = [i for i in node.input if not i.startswith("^")]
            controls = [i for i in node.input if i.startswith("^")]
            del node.input[:]
            node.input.extend(data_inputs[:5] + controls)   # x, scale, offset, mean, variance; side inputs dropped
            for attr in ("activation_mode", "num_side_inputs"):
                node.attr.pop(attr, None)
    return out


def _imports(gd: graph_pb2.GraphDef) -> bool:
    """Whether TensorFlow imports ``gd`` as it is, without feeds."""
    try:
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(_for_shape_inference(gd), name="")
    except Exception:
        return False
    return True


def _output_dtype(node: OpNode, index: int) -> tf.DType:
    # Import once without feeds would be slow for big graphs; the dtype attrs cover the ops people feed.
    for key in ("dtype", "T", "out_type", "DstT"):
        if key in node.attrs and node.attrs[key].type:
            return tf.as_dtype(node.attrs[key].type)
    probe = tf.Graph()
    with probe.as_default():
        gd = graph_pb2.GraphDef()
        gd.node.append(node.to_node_def())
        del gd.node[0].input[:]
        try:
            tf.graph_util.import_graph_def(gd, name="")
            return probe.get_operation_by_name(node.name).outputs[index].dtype
        except Exception:
            raise BadInputError(f"cannot feed {node.name}:{index}: its dtype is not known") from None


def _import_error(e: ValueError, feeds: Mapping[TensorRef, tuple[int, ...]]) -> Exception:
    """The error for a failed import: the feeds' fault when ``feeds`` is given (the graph imports without them)."""
    text = first_line(e)
    if feeds:
        shown = ", ".join(f"{k}={v}" for k, v in feeds.items())
        return BadInputError(f"feed_shapes ({shown}) do not fit the graph: {text}")
    return MalformedGraphError(f"TensorFlow cannot import the graph: {text}")


def require_known(graph: GraphIR, tensors: Iterable[TensorRef]) -> None:
    """Raise one ``UnknownShapeError`` listing every tensor in ``tensors`` whose size is unknown."""
    unknown = [t for t in tensors if graph.spec(t).nbytes is None]
    if not unknown:
        return
    placeholders = sorted(
        {str(t) for t in unknown if graph[t.node].op in FEEDABLE_OPS}
    )
    shown = ", ".join(f"{t} {_shape_text(graph.spec(t).shape)}" for t in unknown[:12])
    more = f" and {len(unknown) - 12} more" if len(unknown) > 12 else ""
    hint = (
        f"give their full shapes, e.g. feed_shapes={{{placeholders[0]!r}: (...)}} (CLI: --feed-shape "
        f"{placeholders[0]}=D1,D2)" if placeholders else
        "give full shapes to the placeholders they depend on with feed_shapes / --feed-shape, or give the "
        "graph static shapes (e.g. tf.ensure_shape)"
    )
    raise UnknownShapeError(
        f"sizes unknown for {len(unknown)} tensor(s): {shown}{more}; {hint}", [str(t) for t in unknown]
    )


def _shape_text(shape: tuple[int | None, ...] | None) -> str:
    if shape is None:
        return "(unknown rank)"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
