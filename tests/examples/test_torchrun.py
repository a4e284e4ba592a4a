"""examples/torchrun.sh in its multi-node form: two 'nodes' on this machine, c10d rendezvous."""

import os
import subprocess
import sys
from pathlib import Path

from megapipe.parallel.launch import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --ffn-hidden-size 64 "
    "--moe-ffn-hidden-size 32 --seq-length 16 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 2 --log-interval 1 --eval-interval 0"
).split()


def test_torchrun_script_two_nodes_with_c10d_rendezvous(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("pack my box with five dozen liquor jugs\n" * 100)
    env = dict(os.environ, NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RDZV_ID=f"test-{os.getpid()}", PYTHON=sys.executable)
    cmd = ["bash", str(REPO / "examples" / "torchrun.sh"), *TINY, "--data-path", str(data)]
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=240)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    report = "\n".join(f"--- node {i} (exit {n.returncode}):\n{o}"
                       for i, (n, o) in enumerate(zip(nodes, outputs)))
    assert all(n.returncode == 0 for n in nodes), report
    log = "".join(outputs)
    assert "world 4 = pp 2 x dp 2 (ep 2)" in log, report
    assert "iter 2/2 | loss" in log, report
