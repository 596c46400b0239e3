"""A cluster's life: `up` and `down`, above the daemon they start and stop."""
