"""The subcommands: arguments, exit codes and printing; the work is in ``egressd.cli.wiring`` and the packages below."""
