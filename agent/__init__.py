"""The agent runner: a model whose every shell command runs in the sandbox.

What flows through it, in order:

1. ``spec`` parses ``--model SPEC`` and finds the API key in the environment;
   ``open_model`` builds a client: ``openai_chat`` (any OpenAI-compatible
   Chat Completions endpoint), ``anthropic_messages`` (the Anthropic Messages
   API) or ``script`` (replays a JSON list of steps). Both HTTP clients send
   through ``endpoint`` (timeout, retries with backoff, clear errors, key
   redaction, no proxy variables).
2. ``prompt`` fills the sandboxed-agent system prompt (task, working
   directory, allowed domains, limits) and renders each command's
   observation (exit code, bounded output, limits hit, egress refusals).
3. ``loop.run_agent`` asks the model, runs each ``bash`` call through an
   ``Executor`` (the sandbox, implemented by ``cli`` on a SandboxSession),
   and stops on a final answer, the step cap or two timeouts in a row.
4. ``transcript`` writes the steps and the final answer as JSON Lines.

``model`` holds the provider-neutral types the others share. The package
never imports the proxy (import-linter checks it): egress refusals arrive as
``audit.views.Refusal`` values on the executor's observations.

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
