"""What a run did: the training log, profile traces, their summary and the costs they measure."""
