"""megapipe.pairing: inside a combined step, which node runs beside which, and when.

``order`` is the pair order (the one statement of what the engine issues on which stream and
what the simulator times), standing on ``slots`` (what runs beside what in a layer pair) and
``layer_pair`` (a layer pair's slots and waits, worked out once per pair of layer shapes);
``timing`` the node-level timing model both use. Pure Python, no
torch.
"""
