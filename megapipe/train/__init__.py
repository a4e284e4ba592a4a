"""megapipe.train: the pretraining application behind `megapipe pretrain`."""
