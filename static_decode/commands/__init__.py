"""The commands layer: the `static-decode` CLI (generate, demo, bench, capture-report) and the torchrun launch.

The top of the layers (core <- capture/ <- the generator <- commands): the only layer that imports all the
others, and nothing imports it except `python -m static_decode`.
"""
