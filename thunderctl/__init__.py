"""thunderctl: a program-aware scheduler and gateway in front of vLLM workers, and its command line."""
