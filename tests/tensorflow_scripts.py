"""A user's TensorFlow training script, for the tests of ``code.framework: tensorflow``
(tests/trainer_pkg/test_tensorflow_framework.py, tests/e2e/test_tensorflow_jobs.py).

It trains a linear model (true weights 1, -2, 0.5, 3) from 0 with ``MultiWorkerMirroredStrategy`` in a
plain custom loop (no Keras: keras-team/keras#20585), each worker on its own data, reports the loss
and the final weights ``w0``..``w3`` with ``report.log`` and writes them, its ``TF_CONFIG`` and its pid
to ``<TRAINBOARD_MODEL_DIR>/weights-<RANK>.json``. ``--fail-rank R`` makes worker R exit 3 before the
strategy; ``--ignore-sigterm`` makes every worker ignore SIGTERM, as a worker blocked in the strategy's
set-up does; ``--never-start-rank R`` makes worker R (``all``: every worker) wait forever before
TensorFlow (its server never listens) ignoring SIGTERM. A worker that ignores SIGTERM prints ``worker R ignores SIGTERM`` first.
"""

from __future__ import annotations

TF_SCRIPT = '''\
"""A user's TensorFlow script: MultiWorkerMirroredStrategy, a linear model, a plain custom loop."""
import argparse
import json
import os
import signal

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--ignore-sigterm", action="store_true")
p.add_argument("--never-start-rank", default="-1")  # a rank, or all
args = p.parse_args()
never_starts = args.never_start_rank in (os.environ["RANK"], "all")
if args.ignore_sigterm or never_starts:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a TF worker blocked in the strategy's set-up behaves
    print(f"worker {os.environ['RANK']} ignores SIGTERM", flush=True)
if int(os.environ["RANK"]) == args.fail_rank:
    raise SystemExit(3)
if never_starts:  # its TF server never starts
    import threading
    threading.Event().wait()

import numpy as np
import tensorflow as tf

from trainer_pkg import report

strategy = tf.distribute.MultiWorkerMirroredStrategy()
rank = int(os.environ["RANK"])
rng = np.random.default_rng(rank)  # each worker trains on its own data
x = tf.constant(rng.normal(size=(64, 4)), tf.float32)
y = tf.matmul(x, tf.constant([[1.0], [-2.0], [0.5], [3.0]]))
with strategy.scope():
    # MEAN: an update made in replica context is averaged over every worker's (the all-reduce).
    w = tf.Variable(tf.zeros([4, 1]), aggregation=tf.VariableAggregation.MEAN)


@tf.function
def step(x, y):
    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    return strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(replica, args=(x, y)), axis=None)


for i in range(args.steps):
    loss = float(step(x, y))
final = [float(v) for v in w.numpy().ravel()]
report.log(step=args.steps, loss=loss, **{f"w{i}": v for i, v in enumerate(final)})
with open(os.path.join(report.model_dir(), f"weights-{rank}.json"), "w") as f:
    json.dump({"weights": final, "loss": loss, "world_size": int(os.environ["WORLD_SIZE"]),
               "tf_config": json.loads(os.environ["TF_CONFIG"]), "pid": os.getpid()}, f)
'''
