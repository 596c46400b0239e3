"""`python -m thunderctl`: the command line."""

from thunderctl.cli import app

app(prog_name="thunderctl")
