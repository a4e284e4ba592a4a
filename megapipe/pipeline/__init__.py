"""megapipe.pipeline: the engine that runs lowered schedules on a rank's stages."""
