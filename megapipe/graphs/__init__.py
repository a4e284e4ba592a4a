"""megapipe.graphs: CUDA graphs of static nodes (Megatron's ``--cuda-graph-impl local``).

``nodes`` wraps the static nodes of a layer plan (``NodeGraphs``), ``capture`` captures one
node's instances (``instance``: one captured copy, its lease, what it hands out; ``recorder``:
the layer state a node sees while captured), ``replay`` replays one as an autograd function,
``rules`` holds the flags' rules (pure Python, read by the CLI).
"""
