"""Collection for the Megatron tests: a module may define ``takes_part(item) -> bool`` to say
which of its parametrized combinations run (``test_mcore_adapter.py``: which case on which
megatron-core release); the rest are deselected here instead of being generated and skipped."""


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        selector = getattr(getattr(item, "module", None), "takes_part", None)
        if selector is not None and hasattr(item, "callspec") and not selector(item):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
