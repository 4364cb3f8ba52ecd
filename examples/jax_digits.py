# SPDX-License-Identifier: Apache-2.0
"""Data-parallel training of an MLP with JAX and optax on scikit-learn's bundled 8x8 digits (no download).

    shmcommrun -np 2 python examples/jax_digits.py

Each rank trains on its shard of the training set. The whole step is one shmcomm.jax.jit function (jax.jit on JAX's
fast dispatch): the gradient, the DistributedOptimizer's allreduce of it (one fused collective, inside the compiled
step) and the update. Rank 0's
initial parameters are broadcast first, so every rank takes identical steps; the learning rate scales with the
number of ranks (the global batch grows with it). At the end the ranks check they hold identical parameters and
rank 0 reports test accuracy."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import shmcomm.jax as sj


def dataset(seed=0):
    digits = load_digits()
    x = (digits.images / 16.0).reshape(len(digits.target), -1).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def init_params(key, sizes=(64, 128, 64, 10)):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) * np.sqrt(2.0 / fan_in),
                       "b": jnp.zeros(fan_out)})
    return params


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--fp16", action="store_true", help="send the gradients as float16")
    args = parser.parse_args()

    sj.init()
    rank, size = sj.rank(), sj.size()
    (x_train, y_train), (x_test, y_test) = dataset()
    x_train, y_train = x_train[rank::size], y_train[rank::size]

    # Deliberately different on every rank: the broadcast makes them equal.
    params = sj.broadcast_parameters(init_params(jax.random.PRNGKey(42 + rank)), root_rank=0)
    tx = sj.DistributedOptimizer(optax.sgd(args.lr * size, momentum=0.9),
                                 compression=sj.Compression.fp16 if args.fp16 else sj.Compression.none)
    state = tx.init(params)

    @sj.jit
    def train_step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    steps = len(y_train) // args.batch_size
    for epoch in range(args.epochs):
        perm = np.random.default_rng(1000 + epoch).permutation(len(y_train))
        for s in range(steps):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            params, state, loss = train_step(params, state, x_train[idx], y_train[idx])
        if rank == 0:
            print("epoch %d loss %.4f" % (epoch + 1, float(loss)), flush=True)

    accuracy = float(jnp.mean(jnp.argmax(predict(params, x_test), 1) == y_test))
    flat = np.concatenate([np.asarray(leaf).reshape(-1) for leaf in jax.tree_util.tree_leaves(params)])
    everyone = np.asarray(sj.allgather(flat[None], name="final_params"))
    identical = all(np.array_equal(everyone[0], everyone[r]) for r in range(size))
    if rank == 0:
        print("ranks %d, weights identical on all ranks: %s, test accuracy %.2f%%" % (size, identical,
                                                                                      100 * accuracy), flush=True)
    sj.shutdown()
    if not identical:
        raise SystemExit("weights differ between ranks")


if __name__ == "__main__":
    main()
