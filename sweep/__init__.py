"""trnsweep sweep room: study specs, Optuna storage, the Ray driver and the trial supervisor."""
