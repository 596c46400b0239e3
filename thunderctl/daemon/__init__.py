"""The cluster daemon: gateway, scheduler loop, health polling and the control socket in one process."""
