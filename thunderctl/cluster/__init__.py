"""The cluster: plans, nodes and their transports, preflight, and bringing workers and the daemon up and down."""
