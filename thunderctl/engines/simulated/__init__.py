"""The simulated engine: `sim/`'s vLLM model stepping in real time behind the part of vLLM's OpenAI
API and `/metrics` the gateway uses, so a cluster of simulated workers starts with `up` like vLLM."""
