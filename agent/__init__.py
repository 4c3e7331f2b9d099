"""The agent runner: a model whose every shell command runs in the sandbox."""
