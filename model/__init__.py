"""trnsweep model room: the GPT, its optimiser, data, training loop and evaluation.

It knows nothing of sweeps: every run is configured by one flat dict and reports JSON lines.
"""
