"""The launcher: sandboxes whose only way out is egressd (bubblewrap + netns, Docker).

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
