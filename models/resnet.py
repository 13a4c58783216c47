"""Bottleneck ResNet (He et al. 2016) of any depth, as a TF1 graph builder with one training step.

Each bottleneck block is 1x1 -> 3x3 -> 1x1 convolutions, each followed by batch norm (plain ops: moments,
scale, shift) and ReLU (the last ReLU after the residual sum); the first block of every stage has a
projection shortcut (1x1 convolution + batch norm), with stride 2 in every stage after the first.
A block has 3 weighted layers, so ``depth = 3 * blocks + 2`` (stem convolution and classifier):

* 50, 101, 152 and 200 use the ImageNet layouts (4 stages: 3-4-6-3, 3-4-23-3, 3-8-36-3, 3-24-36-3);
* any other ``depth = 9n + 2`` uses the CIFAR layout of He et al. 2016b (3 stages of ``n`` blocks: 164, 1001);
* ``stages=s`` asks for ``s`` equal stages, so ``depth = 3 * s * n + 2``.

The stem is a 3x3 convolution for images up to 64 pixels, else 7x7 stride 2 and a 3x3 max pool, as in the
papers. Stage ``i`` has bottleneck width ``width * 2**i`` and ``4 * width * 2**i`` output channels.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from models._layers import Seeds, batch_norm, build_graph, check_optimizer, conv2d, dense, require, train_step
from tfmem import BadInputError
from tfmem.examples import Built

v1 = tf.compat.v1

IMAGENET_LAYOUTS: dict[int, tuple[int, ...]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
EXPANSION = 4


def stage_blocks(depth: int, stages: int | None = None) -> tuple[int, ...]:
    """Bottleneck blocks per stage for ``depth`` (see the module's docstring for the layouts).

    Examples
    --------
    >>> stage_blocks(50), stage_blocks(164), stage_blocks(101, stages=3)
    ((3, 4, 6, 3), (18, 18, 18), (11, 11, 11))
    >>> stage_blocks(60)
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: resnet: depth 60 is not 50, 101, 152, 200 or 9n+2 (n >= 1); nearest: 56 or 65
    """
    if stages is None and depth in IMAGENET_LAYOUTS:
        return IMAGENET_LAYOUTS[depth]
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise BadInputError(f"resnet: stages must be an int >= 1, got {stages!r}")
    count = 3 if stages is None else stages
    per = 3 * count
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < per + 2 or (depth - 2) % per:
        form = "50, 101, 152, 200 or 9n+2" if stages is None else f"{per}n+2"
        if isinstance(depth, int) and depth > per + 2:
            below = (depth - 2) // per * per + 2
            hint = f"nearest: {below} or {below + per}"
        else:
            hint = f"smallest: {per + 2}"
        raise BadInputError(f"resnet: depth {depth!r} is not {form} (n >= 1); {hint}")
    return ((depth - 2) // per,) * count


def depth_of(blocks_per_stage: int, stages: int = 3) -> int:
    """The depth of a ResNet with ``stages`` equal stages of ``blocks_per_stage`` bottleneck blocks.

    Examples
    --------
    >>> depth_of(18), depth_of(111)
    (164, 1001)
    """
    return 3 * stages * blocks_per_stage + 2


def bottleneck(x: tf.Tensor, width: int, stride: int, project: bool, name: str, seeds: Seeds) -> tf.Tensor:
    """One bottleneck block; ``project`` adds the 1x1 projection shortcut."""
    with v1.variable_scope(name):
        h = tf.nn.relu(batch_norm(conv2d(x, width, 1, 1, "conv1", seeds), "bn1"))
        h = tf.nn.relu(batch_norm(conv2d(h, width, 3, stride, "conv2", seeds), "bn2"))
        h = batch_norm(conv2d(h, EXPANSION * width, 1, 1, "conv3", seeds), "bn3")
        shortcut = batch_norm(conv2d(x, EXPANSION * width, 1, stride, "proj", seeds), "bn_proj") if project else x
        return tf.nn.relu(h + shortcut)


def build(depth: int = 50, batch: int = 16, image: int = 32, classes: int = 10, width: int = 16,
          stages: int | None = None, optimizer: str = "momentum", lr: float = 0.01, seed: int = 0) -> Built:
    """A bottleneck ResNet classifier and one training step (softmax cross-entropy).

    Parameters
    ----------
    depth : weighted layers: 50/101/152/200 (ImageNet layouts) or 9n+2 (3 stages), see ``stage_blocks``
    batch, image : batch size and square image side (placeholder ``images`` is ``(batch, image, image, 3)``)
    classes : output classes (placeholder ``labels`` is ``(batch,)`` int32)
    width : bottleneck width of the first stage (64 in the ImageNet models, 16 in the CIFAR ones)
    stages : force ``stages`` equal stages (``depth = 3 * stages * n + 2``)
    optimizer, lr : ``"sgd"``, ``"momentum"`` or ``"adam"`` and its learning rate
    seed : graph seed and feed seed

    Returns
    -------
    Built
        fetches ``["loss:0", "train_op"]``; feeds ``images:0`` and ``labels:0``.

    Raises
    ------
    BadInputError
        For a depth that fits no layout, or sizes below their minimum.

    Examples
    --------
    >>> m = build(depth=11, batch=2, image=8, width=4)
    >>> m.fetches, m.feed_shapes["images:0"]
    (['loss:0', 'train_op'], (2, 8, 8, 3))
    """
    require("resnet", batch=(batch, 1), image=(image, 1), classes=(classes, 2), width=(width, 1))
    check_optimizer("resnet", optimizer)
    layout = stage_blocks(depth, stages)

    def body() -> tuple[list[str], dict[str, np.ndarray]]:
        seeds = Seeds(seed)
        images = v1.placeholder(tf.float32, (batch, image, image, 3), name="images")
        labels = v1.placeholder(tf.int32, (batch,), name="labels")
        if image > 64:
            h = tf.nn.relu(batch_norm(conv2d(images, width, 7, 2, "stem", seeds), "stem_bn"))
            h = tf.nn.max_pool2d(h, 3, 2, "SAME")
        else:
            h = tf.nn.relu(batch_norm(conv2d(images, width, 3, 1, "stem", seeds), "stem_bn"))
        for s, blocks in enumerate(layout):
            for b in range(blocks):
                stride = 2 if s > 0 and b == 0 else 1
                h = bottleneck(h, width * 2**s, stride, b == 0, f"stage{s}/block{b}", seeds)
        logits = dense(tf.reduce_mean(h, axis=(1, 2)), classes, "fc", seeds)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        return ["loss:0", train_step(loss, optimizer, lr)], _feeds(seed, batch, image, classes)

    return build_graph("resnet", body, seed)


def _feeds(seed: int, batch: int, image: int, classes: int) -> dict[str, np.ndarray]:
    # Class c's images have mean c / classes in channel 0: learnable, so the loss visibly falls.
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, batch).astype(np.int32)
    images = rng.standard_normal((batch, image, image, 3)).astype(np.float32)
    images[..., 0] += (labels / classes)[:, None, None]
    return {"images:0": images, "labels:0": labels}
