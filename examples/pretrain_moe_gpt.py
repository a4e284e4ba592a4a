"""Pretrain an MoE GPT with megapipe (Megatron's flag names); the same as ``megapipe pretrain``.

Run it directly (it starts its own processes on CPU), or under torchrun or srun:

    python examples/pretrain_moe_gpt.py                     # built-in demo: 4 CPU processes
    bash examples/torchrun.sh --train-iters 1000            # torchrun, one host
    sbatch -N 2 --gpus-per-node=8 examples/slurm/pretrain.sbatch

``python examples/pretrain_moe_gpt.py --help`` lists every flag.
"""

import sys

from megapipe.train.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
