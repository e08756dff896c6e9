"""Test-only entry: the trainer (``trainer_pkg.launch``) with one real rank made slower.

    torchrun --standalone --nproc_per_node 2 tests/trainer_pkg/slow_rank.py --config job.json

``SLOW_RANK`` (a rank number) sleeps ``SLOW_RANK_S`` seconds in the forward of the model's last layer,
every forward: for ddp and fsdp once per batch, for a pipeline once per micro-batch of the last
stage. To the trainer that is simply a rank whose forward takes longer, as on a slower or busier
machine.
"""

from __future__ import annotations

import os
import sys
import time

from trainer_pkg import launch, models, train
from trainer_pkg.metrics import exit_process

_build_model = models.build_model


def _slow_build_model(*args, **kwargs):
    model = _build_model(*args, **kwargs)
    if os.environ.get("RANK") == os.environ["SLOW_RANK"]:
        seconds = float(os.environ["SLOW_RANK_S"])
        _, last = models.sequential_layers(model)[-1]
        last.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model


train.build_model = _slow_build_model

if __name__ == "__main__":
    exit_process(launch.main(sys.argv[1:]))
