"""megapipe.graphs: CUDA graphs of static nodes (Megatron's ``--cuda-graph-impl local``).

``nodes`` wraps the static nodes of a layer plan (``NodeGraphs``), ``capture`` captures and
replays one node's graphs, ``rules`` holds the flags' rules (pure Python, read by the CLI).
"""
