"""``python -m fastpack``: the ``fastpack`` command."""

from .cli import main

main(prog_name="fastpack")
