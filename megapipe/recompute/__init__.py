"""megapipe.recompute: activation recompute inside a node's backward.

``function`` recomputes one function (selective recompute, ``--recompute-modules``), ``full``
recomputes whole compute nodes (``--recompute-granularity full``), ``layer_groups`` makes several
layers one node plan for full recompute of N > 1 layers at a time.
"""
