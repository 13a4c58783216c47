"""TensorFlow's own memory estimate, for cross-checking the simulator: Grappler's virtual cluster.

``grappler_peak`` places the graph on a virtual device of the given type and memory size (ops already on
``host`` go to a virtual host CPU) and asks Grappler's ``DeterminePeakMemoryUsage`` for its peak. Reports
label these figures "Grappler estimate".
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorflow.core.protobuf import device_properties_pb2, meta_graph_pb2
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import item as gitem

from tfmem.errors import BadInputError, MalformedGraphError, first_line
from tfmem.ir.devices import check_device, same_device
from tfmem.ir.execution import fetch_names
from tfmem.ir.graph import TensorRef
from tfmem.ir.loading import GraphSource, to_graph_def
from tfmem.units import parse_bytes

VIRTUAL_DEVICE = "/job:localhost/replica:0/task:0/device:{}:0"
VIRTUAL_HOST = "/job:localhost/replica:0/task:0/device:CPU:0"


def grappler_peak(
    graph: GraphSource,
    fetches: Iterable[str],
    *,
    device_type: str = "GPU",
    memory: int | str = "12GiB",
    host: str | None = None,
) -> int:
    """Grappler's estimate of the peak bytes on a virtual ``device_type`` device with ``memory`` bytes.

    Parameters
    ----------
    graph : any graph source (see ``tfmem.load``)
    fetches : tensor or op names to compute
    device_type : "GPU" or "CPU"
    memory : the virtual device's memory, e.g. "12GiB" (a TitanX) or "16GiB" (a V100)
    host : device string of ops that stay in host memory (they go to a virtual CPU and are not counted)

    Raises
    ------
    BadInputError
        For a malformed argument or a fetch that names no op of the graph.
    MalformedGraphError
        For a graph Grappler cannot estimate.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.zeros((1024, 1024), name="x")
    ...     y = tf.identity(tf.math.sin(x), name="y")
    >>> grappler_peak(g, ["y:0"]) >= 4 * 1024 * 1024
    True
    """
    names = fetch_names(fetches)
    if not isinstance(device_type, str) or device_type.upper() not in ("GPU", "CPU"):
        raise BadInputError(f"device_type must be 'GPU' or 'CPU', got {device_type!r}")
    nbytes = parse_bytes(memory, what="memory", minimum=1)
    check_device(host, "host")
    gd = to_graph_def(graph)
    nodes = {n.name for n in gd.node}
    for name in names:
        if (TensorRef.parse(name).node if ":" in name else name) not in nodes:
            raise BadInputError(f"fetch {name!r} names no op of the graph; name a tensor ('loss:0') or an op "
                                "('train_op') of it")
    target = VIRTUAL_DEVICE.format(device_type.upper())
    for node in gd.node:
        node.device = VIRTUAL_HOST if host and node.device and same_device(node.device, host) else target
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(gd)
    keep = meta.collection_def["train_op"].node_list.value
    keep.extend(TensorRef.parse(f).node if ":" in f else f for f in names)
    devices = [_named(target, device_type.upper(), nbytes)]
    if device_type.upper() != "CPU":
        devices.append(_named(VIRTUAL_HOST, "CPU", 1 << 40))
    try:
        cluster = gcluster.Cluster(devices=devices)
        peaks = cluster.DeterminePeakMemoryUsage(gitem.Item(meta))
    except Exception as e:
        raise MalformedGraphError(f"Grappler could not estimate the graph's memory: {first_line(e)}") from None
    return int(max(peaks.get(target, (0, []))[0], 0))


def _named(name: str, device_type: str, memory_bytes: int) -> device_properties_pb2.NamedDevice:
    props = device_properties_pb2.DeviceProperties(
        type=device_type, memory_size=memory_bytes, frequency=1500, num_cores=80 if device_type == "GPU" else 8,
        bandwidth=900_000 if device_type == "GPU" else 50_000,
    )
    return device_properties_pb2.NamedDevice(name=name, properties=props)
