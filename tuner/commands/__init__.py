"""One module per ``kvtune`` command: ``NAME``, ``HELP``, ``add_arguments(parser)``, ``run(args) -> int``."""
