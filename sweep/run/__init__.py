"""The run itself: driver, supervisor, outcomes."""
