"""The subcommands: arguments, exit codes and printing; the work is in ``cli.wiring`` and the packages below."""
