"""megapipe.sim"""
