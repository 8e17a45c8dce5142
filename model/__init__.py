"""trnsweep model room: the GPT, its optimiser, data, training loop and evaluation; knows nothing of sweeps."""
