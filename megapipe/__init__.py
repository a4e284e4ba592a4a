"""megapipe: hide the expert-parallel all-to-all of MoE training behind computation.

The public API is re-exported here; everything else may change.
"""

__version__ = "0.1.0"

# The public API, imported on first use (PEP 562) so that importing a torch-free part such as
# megapipe.schedule does not pull in torch.
_RUNTIME_EXPORTS = {
    # schedules (pure Python) and their simulation
    "build_schedule": "megapipe.schedule",
    "Schedule": "megapipe.schedule",
    "Action": "megapipe.schedule",
    "validate": "megapipe.schedule",
    "ScheduleError": "megapipe.schedule",
    "simulate": "megapipe.sim",
    "Costs": "megapipe.sim",
    # process groups, MoE layer, reference model, overlap engine
    "ParallelConfig": "megapipe.parallel",
    "create_groups": "megapipe.parallel",
    "release_groups": "megapipe.parallel",
    "init_distributed": "megapipe.parallel",
    "MoEConfig": "megapipe.moe",
    "MoELayer": "megapipe.moe",
    "EmulatedLink": "megapipe.moe",
    "GPTConfig": "megapipe.models",
    "build_stage": "megapipe.models",
    "combined_step": "megapipe.overlap",
    "make_streams": "megapipe.overlap",
    # pipeline executor and Megatron front end
    "get_forward_backward_func": "megapipe.megatron.forward_backward",
    "McoreGPTStage": "megapipe.megatron.mcore_adapter",
    "PipelineExecutor": "megapipe.pipeline.executor",
    "ExecutorOptions": "megapipe.pipeline.executor_options",
    "StepResult": "megapipe.pipeline.executor",
    "TensorSpec": "megapipe.pipeline.p2p",
    "P2PError": "megapipe.pipeline.p2p",
    "P2PTimeoutError": "megapipe.pipeline.p2p",
    "P2PPeerError": "megapipe.pipeline.p2p",
    # bf16 with fp32 main weights and gradients (Megatron's --bf16)
    "attach_main_grads": "megapipe.precision.main_grad",
    "cast_to_bf16": "megapipe.train.optim.mixed_precision",
    "MixedPrecisionAdamW": "megapipe.train.optim.mixed_precision",
}


def __getattr__(name: str):
    if name in _RUNTIME_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_RUNTIME_EXPORTS[name]), name)
    raise AttributeError(f"module 'megapipe' has no attribute {name!r}")


__all__ = sorted(_RUNTIME_EXPORTS)


def __dir__() -> list[str]:
    return __all__ + ["__version__"]
