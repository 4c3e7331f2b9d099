"""Settings and presets.

- ``settings``  the one root ``Settings`` object (pydantic-settings): defaults,
  then the TOML file, then ``EGRESSD_*`` variables, then the command line;
- ``presets``   named allowlists (``python``, ``node``, ``github``, ...).

Nothing here reads the environment at import time; ``cli`` builds the settings
once and passes sections down.

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
