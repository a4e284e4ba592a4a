"""The kernels' heavy sweeps: tests marked ``kernel_sweep`` (every kernel at every shape users
run, under Triton's interpreter and compiled for sm_90 and sm_100; minutes) are deselected
unless ``MEGAPIPE_KERNEL_SWEEP=1``:

    MEGAPIPE_KERNEL_SWEEP=1 .venv/bin/python -m pytest tests/kernels
"""

import os

SWEEP = os.environ.get("MEGAPIPE_KERNEL_SWEEP") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kernel_sweep: a heavy kernel sweep, run with MEGAPIPE_KERNEL_SWEEP=1")


def pytest_collection_modifyitems(config, items):
    if SWEEP:
        return
    drop = [item for item in items if item.get_closest_marker("kernel_sweep")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if not item.get_closest_marker("kernel_sweep")]
