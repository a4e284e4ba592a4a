"""megapipe.train: the pretraining application behind `megapipe pretrain`.

Here: the job, one training step, the loop, the command and the ranks it starts and watches.
``optim/``: gradients to weights; ``config/``: the flags made one typed ``JobConfig``;
``checkpoint/``: save and resume; ``observe/``: logs and traces. Each imports those before it.
"""
