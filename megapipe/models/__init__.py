"""megapipe.models: the reference MoE GPT, written as node plans, and its split into stages."""

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import GPTStage, TransformerLayer, gpt_loss
from megapipe.models.split import build_stage, split_layers, stage_ids_of_rank

__all__ = [
    "GPTConfig",
    "GPTStage",
    "TransformerLayer",
    "build_stage",
    "gpt_loss",
    "split_layers",
    "stage_ids_of_rank",
]
