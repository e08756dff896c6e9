"""The Ray Train script of the ``code.framework: ray`` tests (tests/trainer_pkg/test_framework_ray.py,
tests/e2e/test_ray_gpubox.py): a ``TorchTrainer`` of ``TRAINBOARD_RAY_NUM_WORKERS`` workers (gloo on
CPU) whose rank 0 reports ``rank_sum``, the all-reduced sum of (world rank + 1) over the workers (3.0 for
two), with ``report.log`` at step 1. Each worker prints ``worker R of W on node <Ray node id>``.

Arguments: ``--spread`` places the workers one per node (``STRICT_SPREAD``: it cannot run unless every
node joined), else Ray packs them; ``--hold`` makes every worker wait after its report until the job is
stopped. The script prints ``fit ended, error None`` when ``fit`` returns.
"""

RAY_TRAIN_SCRIPT = '''\
import os
import sys
import threading

import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    import torch
    import torch.distributed as dist

    from trainer_pkg import report

    ctx = ray.train.get_context()
    ranks = torch.tensor([float(ctx.get_world_rank() + 1)])
    dist.all_reduce(ranks)  # TorchTrainer's process group (gloo on CPU): 1 + 2
    node = ray.get_runtime_context().get_node_id()
    print(f"worker {ctx.get_world_rank()} of {ctx.get_world_size()} on node {node}", flush=True)
    report.log(step=1, rank_sum=ranks.item())
    if config["hold"]:
        threading.Event().wait()  # until the test stops the job


ray.init()  # RAY_ADDRESS: this job's head
trainer = TorchTrainer(
    loop, train_loop_config={"hold": "--hold" in sys.argv},
    scaling_config=ScalingConfig(num_workers=int(os.environ["TRAINBOARD_RAY_NUM_WORKERS"]),
                                 placement_strategy="STRICT_SPREAD" if "--spread" in sys.argv else "PACK"),
    run_config=RunConfig(storage_path=os.path.join(os.environ["TRAINBOARD_CHECKPOINT_DIR"], "ray"), name="job"))
result = trainer.fit()
print(f"fit ended, error {result.error}", flush=True)
'''
