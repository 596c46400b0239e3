"""A deterministic simulator of vLLM under agent load: engine, KV cache, cost model, agents, arms."""
