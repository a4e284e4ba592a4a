"""bf16 training with float32 main weights, moments and gradients (Megatron's ``--bf16``).

The model's parameters and activations are bf16. ``cast_to_bf16`` casts the model and gives every
parameter a float32 ``main_grad`` (``precision.main_grad``): gradients accumulate over the
microbatches in float32, the executor reduces them over DP and expert-DP in float32, and the
norm and clipping read them. ``MixedPrecisionAdamW`` keeps a float32 *main* copy of every
parameter and runs AdamW (fused on CUDA, foreach on CPU) on the main copies with the float32
``main_grad`` as their gradient, so the moments are float32 too; after each step the bf16
parameters are the main weights rounded to bf16.

State per model parameter ``p`` (what a checkpoint saves and restores, as Megatron keeps it):
``optimizer.state[p]`` is AdamW's state of p's main copy — ``step``, ``exp_avg``,
``exp_avg_sq`` — plus ``main_param``, the float32 main weight itself; every entry is a tensor
that can be loaded in place. It exists from construction (zeros, step 0, exactly what AdamW
would create at its first step), so a fresh optimizer can be loaded into. The bf16 parameter is
always ``main_param`` rounded to bf16; after loading main weights, ``copy_main_to_model()``
(or loading the saved bf16 parameters, the same bits) makes the model agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from megapipe.precision.main_grad import (
    accumulated_grad,
    attach_main_grads,
    has_main_grad,
    zero_grads,
)


def cast_to_bf16(modules: Iterable[nn.Module], params: Sequence[nn.Parameter]) -> None:
    """Parameters (and so activations) of ``modules`` to bf16; every trainable one of
    ``params`` (the modules' parameters, each once) gets a float32 ``main_grad``."""
    for module in modules:
        module.to(torch.bfloat16)
    attach_main_grads(params)


class MixedPrecisionAdamW:
    """AdamW on float32 main copies of bf16 parameters (see the module docstring).

    ``param_groups`` are torch AdamW groups (``{"params": [...], "weight_decay": ...}``) of the
    bf16 model parameters, each of which must carry a ``main_grad``; ``adamw`` are AdamW's
    keyword arguments. Duck-types ``torch.optim.Optimizer`` where the training loop needs it:
    ``param_groups`` (the learning rate is set there), ``state``, ``zero_grad``, ``step``,
    ``state_dict``, ``load_state_dict``.
    """

    def __init__(self, param_groups: Sequence[Mapping[str, Any]], **adamw: Any) -> None:
        self.model_params: list[nn.Parameter] = [p for g in param_groups for p in g["params"]]
        for p in self.model_params:
            if p.dtype == torch.float32 or not has_main_grad(p):
                raise ValueError(
                    f"MixedPrecisionAdamW needs low-precision parameters with a float32 "
                    f"main_grad (cast_to_bf16); got a {p.dtype} parameter of shape "
                    f"{tuple(p.shape)}{'' if has_main_grad(p) else ' without main_grad'}"
                )
        self._main = {p: p.detach().float() for p in self.model_params}
        groups = [{**g, "params": [self._main[p] for p in g["params"]]} for g in param_groups]
        self.optimizer = torch.optim.AdamW(groups, **adamw)
        for main in self._main.values():
            self.optimizer.state[main] = self._fresh_state(main)

    def _fresh_state(self, main: torch.Tensor) -> dict[str, torch.Tensor]:
        """What AdamW creates at its first step (fused: step on the device), plus the weight."""
        fused = bool(self.optimizer.defaults.get("fused"))
        return {
            "step": torch.zeros((), dtype=torch.float32, device=main.device if fused else "cpu"),
            "exp_avg": torch.zeros_like(main, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(main, memory_format=torch.preserve_format),
            "main_param": main,
        }

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """``{model parameter: its main copy's state}`` (the same dict objects AdamW uses)."""
        return {p: self.optimizer.state[main] for p, main in self._main.items()}

    def main_param(self, param: nn.Parameter) -> torch.Tensor:
        """The float32 main weight of model parameter ``param``."""
        return self._main[param]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the float32 ``main_grad`` buffers (kept allocated) and drop any ``.grad``."""
        zero_grads(self.model_params)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the main weights with the (reduced, clipped) ``main_grad``; then the bf16
        parameters become the new main weights rounded to bf16."""
        for p, main in self._main.items():
            main.grad = accumulated_grad(p)
        self.optimizer.step()
        for main in self._main.values():
            main.grad = None
        self.copy_main_to_model()

    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        """Every model parameter := its main weight rounded to the parameter's dtype."""
        if self.model_params:
            torch._foreach_copy_(
                # torch's stub asks for a list[Tensor] (invariant): a list of Parameters is one
                self.model_params,  # type: ignore[arg-type]
                list(self._main.values()),
            )

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict of the main copies (each state holds its ``main_param``)."""
        return self.optimizer.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output: moments and main weights, then the bf16 weights."""
        self.optimizer.load_state_dict(state_dict)
        for main in self._main.values():
            state = self.optimizer.state[main]
            main.copy_(state["main_param"])
            state["main_param"] = main  # AdamW's loader made a copy; keep the one we step
        self.copy_main_to_model()
