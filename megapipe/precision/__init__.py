"""megapipe.precision: where a parameter's gradient accumulates (``main_grad``: Megatron's fp32
main gradients of a bf16 model), shared by the engine, the experts and the optimizer."""
