"""Flags shared by the pretrain tests."""

# The default run's shape (pp=2, vpp=2, ep=2, overlap on, 4 ranks), shrunk to seconds.
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
    "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32", "--seq-length", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2",
    "--log-interval", "2", "--eval-iters", "1",
]
