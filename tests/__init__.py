"""egressd's tests: unit/ (pure logic), integration/ (real sockets, processes, namespaces,
containers), conformance/ (suites every implementation of an interface passes), fakes/,
fuzz/, and project/ (the README, the install, the import namespace)."""

from pathlib import Path

# The checkout's root, wherever a test file sits beneath tests/.
REPO = Path(__file__).resolve().parent.parent
