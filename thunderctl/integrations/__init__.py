"""Agent frameworks on a thunderctl cluster: program ids in their requests, sandboxes for their tools.

`cluster` speaks the gateway's program and sandbox API and needs nothing beyond thunderctl;
`mini_swe_agent` needs the optional `mini-swe-agent` package (`pip install 'thunderctl[agents]'`).
docs/agents.md shows both, and how other frameworks set the program id and release it.
"""
