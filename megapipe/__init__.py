"""megapipe: hide the expert-parallel all-to-all of MoE training behind computation.

The public API is re-exported here; everything else may change.
"""

__version__ = "0.1.0"

# Pipeline executor and Megatron front end, imported on first use (PEP 562) so that importing
# a torch-free part such as megapipe.schedule does not pull in torch.distributed.
_RUNTIME_EXPORTS = {
    "get_forward_backward_func": "megapipe.runtime.megatron",
    "PipelineExecutor": "megapipe.runtime.executor",
    "StepResult": "megapipe.runtime.executor",
    "TensorSpec": "megapipe.runtime.p2p",
    "P2PTimeoutError": "megapipe.runtime.p2p",
}


def __getattr__(name: str):
    if name in _RUNTIME_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_RUNTIME_EXPORTS[name]), name)
    raise AttributeError(f"module 'megapipe' has no attribute {name!r}")
