"""What the commands start and tear down: the embedded egressd (``service``), a sandboxed run on either
backend (``session``, ``docker_session``) and the control-API client with its trust checks."""
