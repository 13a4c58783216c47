"""WGAN-GP (Gulrajani et al. 2017): a generator and a critic trained with a gradient penalty.

The penalty ``lambda * mean((||grad_x critic(x_hat)||_2 - 1)^2)`` on random interpolates ``x_hat`` between real
and generated samples makes the critic's training step a second-order gradient (the gradient of a gradient),
which is what this benchmark exercises. One ``train_op`` runs ``critic_steps`` critic updates and then one
generator update, in that order: each later step's forward pass is built under a control dependency on the
step before, so every variable read sees the previous update and the step is deterministic.

Both networks are MLPs over flattened samples of ``data_dim`` values (leaky ReLU in the critic, ReLU in the
generator). The real data is a fixed-seed mixture of Gaussians; noise and interpolation weights are fed.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from models._layers import Seeds, build_graph, dense, require
from tfmem.examples import Built

v1 = tf.compat.v1


def _mlp(x: tf.Tensor, hidden: int, layers: int, out: int, activation, scope: str, seeds: Seeds) -> tf.Tensor:
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        for i in range(layers):
            x = dense(x, hidden, f"dense{i}", seeds, activation)
        return dense(x, out, "out", seeds)


def _critic_loss(real: tf.Tensor, fake: tf.Tensor, eps: tf.Tensor, critic, penalty: float) -> tf.Tensor:
    x_hat = eps * real + (1.0 - eps) * fake
    grad = tf.gradients(tf.reduce_sum(critic(x_hat)), x_hat)[0]
    norm = tf.sqrt(tf.reduce_sum(tf.square(grad), axis=1) + 1e-12)
    gp = tf.reduce_mean(tf.square(norm - 1.0))
    return tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real)) + penalty * gp


def build(batch: int = 64, data_dim: int = 64, z_dim: int = 32, hidden: int = 128, layers: int = 3,
          critic_steps: int = 1, penalty: float = 10.0, lr: float = 1e-4, seed: int = 0) -> Built:
    """WGAN-GP's training step: ``critic_steps`` critic updates with gradient penalty, then a generator update.

    Parameters
    ----------
    batch : samples per step; placeholders ``real`` ``(critic_steps, batch, data_dim)``, ``z``
        ``(critic_steps + 1, batch, z_dim)`` and ``eps`` ``(critic_steps, batch, 1)`` (interpolation weights)
    data_dim, z_dim : sample and noise widths
    hidden, layers : width and number of hidden layers of both MLPs
    critic_steps : critic updates per generator update (5 in the paper)
    penalty : the gradient penalty's weight lambda
    lr : Adam's learning rate (beta1 0.5, beta2 0.9, as in the paper)
    seed : graph seed and feed seed

    Returns
    -------
    Built
        fetches ``["loss:0", "gen_loss:0", "train_op"]``: ``loss`` is the first critic step's loss (negative
        Wasserstein estimate plus penalty), ``gen_loss`` the generator's.

    Raises
    ------
    BadInputError
        For sizes below their minimum.

    Examples
    --------
    >>> m = build(batch=4, data_dim=8, z_dim=4, hidden=8, layers=1)
    >>> m.fetches, m.feed_shapes["z:0"]
    (['loss:0', 'gen_loss:0', 'train_op'], (2, 4, 4))
    """
    require("wgan_gp", batch=(batch, 1), data_dim=(data_dim, 1), z_dim=(z_dim, 1), hidden=(hidden, 1),
            layers=(layers, 1), critic_steps=(critic_steps, 1), penalty=(penalty, 0.0), lr=(lr, 0.0))

    def body() -> tuple[list[str], dict[str, np.ndarray]]:
        seeds = Seeds(seed)
        real = v1.placeholder(tf.float32, (critic_steps, batch, data_dim), name="real")
        z = v1.placeholder(tf.float32, (critic_steps + 1, batch, z_dim), name="z")
        eps = v1.placeholder(tf.float32, (critic_steps, batch, 1), name="eps")

        def generator(noise: tf.Tensor) -> tf.Tensor:
            return _mlp(noise, hidden, layers, data_dim, tf.nn.relu, "generator", seeds)

        def critic(x: tf.Tensor) -> tf.Tensor:
            return _mlp(x, hidden, layers, 1, tf.nn.leaky_relu, "critic", seeds)

        previous: list[tf.Operation] = []
        losses = []
        for step in range(critic_steps):
            with tf.control_dependencies(previous), v1.name_scope(f"critic_step{step}"):
                loss = _critic_loss(real[step], generator(z[step]), eps[step], critic, penalty)
                losses.append(loss)
                opt = v1.train.AdamOptimizer(lr, beta1=0.5, beta2=0.9, name=f"critic_adam{step}")
                previous = [opt.minimize(loss, var_list=v1.trainable_variables("critic"))]
        tf.identity(losses[0], name="loss")
        with tf.control_dependencies(previous), v1.name_scope("generator_step"):
            gen_loss = tf.negative(tf.reduce_mean(critic(generator(z[critic_steps]))))
            gen_train = v1.train.AdamOptimizer(lr, beta1=0.5, beta2=0.9, name="gen_adam").minimize(
                gen_loss, var_list=v1.trainable_variables("generator"))
        tf.identity(gen_loss, name="gen_loss")
        train = tf.group(*previous, gen_train, name="train_op")
        return ["loss:0", "gen_loss:0", train.name], _feeds(seed, batch, data_dim, z_dim, critic_steps)

    return build_graph("wgan_gp", body, seed)


def _feeds(seed: int, batch: int, data_dim: int, z_dim: int, critic_steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((8, data_dim)) * 2.0
    pick = rng.integers(0, len(centres), (critic_steps, batch))
    real = centres[pick] + 0.1 * rng.standard_normal((critic_steps, batch, data_dim))
    return {"real:0": real.astype(np.float32),
            "z:0": rng.standard_normal((critic_steps + 1, batch, z_dim)).astype(np.float32),
            "eps:0": rng.uniform(0.0, 1.0, (critic_steps, batch, 1)).astype(np.float32)}
