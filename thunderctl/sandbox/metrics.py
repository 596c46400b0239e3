"""The pool's status as Prometheus text, for the daemon to append to the gateway's /metrics."""

from __future__ import annotations


def _sample(name: str, value: float, **labels: str) -> str:
    rendered = ",".join(f'{key}="{val}"' for key, val in labels.items())
    return f"{name}{{{rendered}}} {value}" if labels else f"{name} {value}"


def render_sandbox_metrics(stats: dict) -> str:
    """`stats` is `SandboxPool.stats()`; values not known yet (no sample) are left out."""
    lines = ["# TYPE thunderctl_sandboxes_available gauge",
             _sample("thunderctl_sandboxes_available", int(stats["available"])),
             "# TYPE thunderctl_sandboxes gauge"]
    lines += [_sample("thunderctl_sandboxes", stats[state], state=state)
              for state in ("warm", "bound", "preparing", "failed", "adopted")]
    for name, key in [("thunderctl_sandbox_prepare_seconds", "prepare_s"),
                      ("thunderctl_sandbox_acquire_to_ready_seconds", "acquire_to_ready_s")]:
        lines.append(f"# TYPE {name} summary")
        summary = stats[key]
        lines += [_sample(name, summary[f"p{q}"], quantile=str(q / 100))
                  for q in (50, 90, 99) if summary[f"p{q}"] is not None]
        lines.append(_sample(f"{name}_count", summary["count"]))
    lines.append("# TYPE thunderctl_sandbox_disk_bytes gauge")
    lines += [_sample("thunderctl_sandbox_disk_bytes", host["disk_bytes"], host=host["url"])
              for host in stats["hosts"] if host["disk_bytes"] is not None]
    # How old that figure is: a reader after a change waits for a measurement taken since.
    lines.append("# TYPE thunderctl_sandbox_disk_age_seconds gauge")
    lines += [_sample("thunderctl_sandbox_disk_age_seconds", round(host["disk_age_s"], 3), host=host["url"])
              for host in stats["hosts"] if host["disk_age_s"] is not None]
    for name, key in [("thunderctl_sandboxes_reaped_total", "reaped"),
                      ("thunderctl_sandbox_images_evicted_total", "evicted_images")]:
        lines += [f"# TYPE {name} counter", _sample(name, stats[key])]
    return "\n".join(lines) + "\n"
