"""What thunderctl's command lines print through: standard output, standard error, and an error that exits."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

out = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `message` as an error (markup in it is shown as typed) and return the exit to raise."""
    err.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(code)
