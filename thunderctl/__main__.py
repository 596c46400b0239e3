from thunderctl.cli import app

app(prog_name="thunderctl")
