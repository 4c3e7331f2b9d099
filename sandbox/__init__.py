"""The launcher: sandboxes whose only way out is egressd (bubblewrap + netns, Docker)."""
