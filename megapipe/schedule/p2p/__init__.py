"""Point-to-point: where the sends and receives of a lowered schedule go, the proof that they
finish under batched p2p, and which sends may go out early."""
