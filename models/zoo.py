"""Training steps of model-zoo networks nobody here wrote: TF-Slim's ResNet-50 v1 and tf_keras' MobileNetV2.

Each is one TF1 graph-mode step (forward, softmax cross-entropy averaged over the batch, Momentum update) with
batch norm in training mode. ``slim_resnet50`` and ``keras_mobilenet_v2`` build batch norm unfused, as
``experiments/optimize_time`` measured them; tfmem plans the zoos' default fused batch norm too
(``tests/test_zoo.py``). ``make`` installs the zoos (``requirements-zoo.lock``, ``--no-deps``);
``available()`` says whether they are installed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tfmem.examples import Built

v1 = tf.compat.v1


def available() -> bool:
    """Whether tf_slim and tf_keras are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("tf_slim", "tf_keras"))


def _step(build_logits: Callable[[tf.Tensor], tf.Tensor], batch: int, size: int, classes: int) -> Built:
    graph, feeds, (images, labels) = _inputs(batch, size, classes)
    with graph.as_default():
        logits = tf.reshape(build_logits(images), (batch, classes))
        mean = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        # Batch norm's moving averages update before the loss is read, as TF-Slim's create_train_op has it (the
        # control edges on the loss alone, not on every gradient op).
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            loss = tf.identity(mean, name="loss")
        train = v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train")
    return Built(graph, ["loss:0", train.name], feeds, _parameters(graph))


def legacy_layers_alias() -> None:
    """TensorFlow 2.21 loads ``tf.compat.v1.layers``' batch norm (TF-Slim's unfused one) from
    ``tf_keras.legacy_tf_layers``, which tf_keras 2.21 ships as ``tf_keras.src.legacy_tf_layers`` only."""
    import tf_keras.src.legacy_tf_layers as legacy

    sys.modules.setdefault("tf_keras.legacy_tf_layers", legacy)
    importlib.import_module("tf_keras.src.legacy_tf_layers.normalization")
    sys.modules.setdefault("tf_keras.legacy_tf_layers.normalization", legacy.normalization)


def slim_resnet50(batch: int = 8, size: int = 64, classes: int = 100) -> Built:
    """TF-Slim's ``resnet_v1_50`` (about 9,600 ops as a training step)."""
    import tf_slim as slim
    from tf_slim.nets import resnet_v1

    legacy_layers_alias()

    def logits(images: tf.Tensor) -> tf.Tensor:
        with slim.arg_scope(resnet_v1.resnet_arg_scope()), slim.arg_scope([slim.batch_norm], fused=False):
            out, _ = resnet_v1.resnet_v1_50(images, num_classes=classes, is_training=True)
        return out

    return _step(logits, batch, size, classes)


def slim_inception_v3(batch: int = 8, size: int = 96, classes: int = 100) -> Built:
    """TF-Slim's ``inception_v3`` as the zoo builds it (fused batch norm, auxiliary logits off)."""
    import tf_slim as slim
    from tf_slim.nets import inception_v3

    legacy_layers_alias()

    def logits(images: tf.Tensor) -> tf.Tensor:
        with slim.arg_scope(inception_v3.inception_v3_arg_scope()):
            out, _ = inception_v3.inception_v3(images, num_classes=classes, is_training=True,
                                               create_aux_logits=False)
        return out

    return _step(logits, batch, size, classes)


@contextlib.contextmanager
def _unfused_keras_batch_norm() -> Iterator[None]:
    """tf_keras' BatchNormalization built with ``fused=False`` while the block runs."""
    from tf_keras.src.layers.normalization.batch_normalization import BatchNormalizationBase

    original = BatchNormalizationBase.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        kwargs["fused"] = False
        original(self, *args, **kwargs)

    BatchNormalizationBase.__init__ = init   # type: ignore[method-assign]
    try:
        yield
    finally:
        BatchNormalizationBase.__init__ = original   # type: ignore[method-assign]


def keras_mobilenet_v2(batch: int = 16, size: int = 96, classes: int = 100) -> Built:
    """tf_keras' ``applications.MobileNetV2`` (``weights=None``; about 5,000 ops as a training step), with unfused
    batch norm (as ``experiments/optimize_time`` measured it)."""
    return _keras_application("MobileNetV2", batch, size, classes, fused=False)


def keras_resnet50(batch: int = 8, size: int = 64, classes: int = 100) -> Built:
    """tf_keras' ``applications.ResNet50`` (``weights=None``; about 14,000 ops as a training step) as the zoo
    builds it, fused batch norm included."""
    return _keras_application("ResNet50", batch, size, classes, fused=True)


def _keras_application(name: str, batch: int, size: int, classes: int, fused: bool) -> Built:
    def logits(images: tf.Tensor) -> tf.Tensor:
        unfused = _unfused_keras_batch_norm() if not fused else contextlib.nullcontext()
        with unfused:
            model = _keras_model(name, images, size, classes)
        out = model.output
        for update in model.updates:   # batch norm's moving averages, where _step collects them
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, update)
        return out

    return _step(logits, batch, size, classes)


# --- every network of both zoos, as each zoo builds a training step ---------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One network of a zoo, at the smallest of the usual image sizes it builds at (its pooling and VALID
    convolutions need that much), with a batch that makes a step take seconds here."""

    zoo: str    # "slim" or "keras"
    net: str    # tf_slim.nets' function name, or tf_keras.applications' class name
    size: int
    batch: int = 4

    @property
    def name(self) -> str:
        return f"{self.zoo}/{self.net}"

    def build(self, classes: int = 10) -> Built:
        """The training step: TF-Slim's with its TF1 loss and ``create_train_op`` (Momentum), tf_keras' with its
        own loss and Adam; fused batch norm in training mode in both, as the zoos default to."""
        if self.zoo == "slim":
            return _slim_step(self.net, self.batch, self.size, classes)
        return _keras_step(self.net, self.batch, self.size, classes)


# tf_slim.nets' networks -> (module, arg scope, image size)
_SLIM = {
    "alexnet_v2": ("alexnet", "alexnet_v2_arg_scope", 224),
    "inception_v1": ("inception", "inception_v1_arg_scope", 224),
    "inception_v2": ("inception", "inception_v2_arg_scope", 64),
    "inception_v3": ("inception", "inception_v3_arg_scope", 128),
    "overfeat": ("overfeat", "overfeat_arg_scope", 231),
    **{f"resnet_v{v}_{d}": (f"resnet_v{v}", "resnet_arg_scope", 64) for v in (1, 2) for d in (50, 101, 152, 200)},
    **{net: ("vgg", "vgg_arg_scope", 224) for net in ("vgg_a", "vgg_16", "vgg_19")},
}
# tf_keras.applications' models that do not build at 32x32 -> the size they build at
_KERAS_SIZES = {"InceptionV3": 96, "InceptionResNetV2": 96, "Xception": 96}


def catalog() -> dict[str, Entry]:
    """Every network of ``tf_slim.nets`` and ``tf_keras.applications`` (``make`` installs both), by name."""
    import tf_keras

    entries = [Entry("slim", net, size, batch=2 if size >= 224 else 4) for net, (_, _, size) in _SLIM.items()]
    entries += [Entry("keras", net, _KERAS_SIZES.get(net, 32))
                for net in sorted(dir(tf_keras.applications)) if net[:1].isupper()]
    return {e.name: e for e in entries}


def _slim_step(net: str, batch: int, size: int, classes: int) -> Built:
    import tf_slim as slim
    from tf_slim import nets

    legacy_layers_alias()
    module_name, scope, _ = _SLIM[net]
    module = getattr(nets, module_name)
    graph, feeds, (images, labels) = _inputs(batch, size, classes)
    with graph.as_default():
        with slim.arg_scope(getattr(module, scope)()):
            logits, _ = getattr(module, net)(images, num_classes=classes, is_training=True)
        v1.losses.sparse_softmax_cross_entropy(labels, tf.reshape(logits, (batch, classes)))
        # the regularisation losses join the total, and the update ops run before it is returned (TF-Slim's way)
        loss = v1.losses.get_total_loss()
        train = slim.learning.create_train_op(loss, v1.train.MomentumOptimizer(0.01, 0.9))
    return Built(graph, [train.name], feeds, _parameters(graph))


def _keras_step(net: str, batch: int, size: int, classes: int) -> Built:
    import tf_keras

    graph, feeds, (images, labels) = _inputs(batch, size, classes)
    with graph.as_default():
        model = _keras_model(net, images, size, classes)
        mean = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, model.output)
        with tf.control_dependencies(model.updates):   # batch norm's moving averages
            loss = tf.identity(mean, name="loss")
        train = v1.train.AdamOptimizer(1e-3).minimize(loss, var_list=model.trainable_weights, name="train")
    return Built(graph, ["loss:0", train.name], feeds, _parameters(graph))


def _keras_model(net: str, images: tf.Tensor, size: int, classes: int) -> Any:
    """``tf_keras.applications.<net>`` on ``images`` (``weights=None``, logits out), batch norm and dropout in
    training mode, built in the current graph."""
    import tf_keras

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # set_learning_phase is deprecated, and the TF1 way
        tf_keras.backend.set_learning_phase(1)
        # a Keras tensor over the placeholder, and its shape: MobileNetV3 takes no other, and with input_shape
        # given every model checks that the tensor is a Keras one
        return getattr(tf_keras.applications, net)(input_tensor=tf_keras.Input(tensor=images),
                                                   input_shape=(size, size, 3), weights=None, classes=classes,
                                                   classifier_activation=None)


def _inputs(batch: int, size: int, classes: int) -> tuple[tf.Graph, dict[str, np.ndarray], tuple[tf.Tensor, tf.Tensor]]:
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    feeds = {"images:0": rng.standard_normal((batch, size, size, 3)).astype(np.float32),
             "labels:0": rng.integers(0, classes, batch).astype(np.int32)}
    with graph.as_default():
        v1.set_random_seed(1234)
        images = v1.placeholder(tf.float32, (batch, size, size, 3), name="images")
        labels = v1.placeholder(tf.int32, (batch,), name="labels")
    return graph, feeds, (images, labels)


def _parameters(graph: tf.Graph) -> int:
    with graph.as_default():
        return sum(int(np.prod(v.shape)) for v in v1.trainable_variables())
