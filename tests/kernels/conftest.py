"""The kernels' heavy checks: tests marked ``heavy_kernels`` (every kernel at every shape users
run, under Triton's interpreter and compiled for sm_90 and sm_100; minutes) are deselected
unless ``MEGAPIPE_HEAVY_KERNELS=1``:

    MEGAPIPE_HEAVY_KERNELS=1 .venv/bin/python -m pytest tests/kernels
"""

import os

HEAVY = os.environ.get("MEGAPIPE_HEAVY_KERNELS") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "heavy_kernels: a heavy kernel check, run with MEGAPIPE_HEAVY_KERNELS=1")


def pytest_collection_modifyitems(config, items):
    if HEAVY:
        return
    drop = [item for item in items if item.get_closest_marker("heavy_kernels")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if not item.get_closest_marker("heavy_kernels")]
