"""Prometheus metrics, kept as plain counters and rendered in the text format.

No client library: the handful of series here are cheaper to count by hand
than to route through a registry on every connection.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Decision latency buckets (seconds): a policy-only decision takes microseconds,
# a resolved one milliseconds, a held one up to the approval timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0)


@dataclass
class Metrics:
    connections_total: Counter[str] = field(default_factory=Counter)  # by kind
    connections_open: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (decision, reason)
    held_requests: int = 0
    # Learn mode: attempts let through that the allowlist alone would have refused or held.
    learned: int = 0
    # Tunnels whose bytes moved in the kernel (splice), counted as they end.
    tunnels_spliced: int = 0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def decided(self, decision: str, reason: str | None, seconds: float) -> None:
        self.decisions[(decision, reason or "")] += 1
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_counts[i] += 1
                return
        self.latency_counts[-1] += 1

    def merged(self, others: list[Metrics]) -> Metrics:
        """These counters with ``others``' added (the workers' of ``serve --workers``): one egressd's."""
        total = Metrics(
            connections_total=Counter(self.connections_total), connections_open=self.connections_open,
            bytes_up=self.bytes_up, bytes_down=self.bytes_down, decisions=Counter(self.decisions),
            held_requests=self.held_requests, learned=self.learned, tunnels_spliced=self.tunnels_spliced,
            latency_counts=list(self.latency_counts), latency_sum=self.latency_sum,
        )  # fmt: skip
        for other in others:
            total.connections_total.update(other.connections_total)
            total.decisions.update(other.decisions)
            total.connections_open += other.connections_open
            total.bytes_up += other.bytes_up
            total.bytes_down += other.bytes_down
            total.held_requests += other.held_requests
            total.learned += other.learned
            total.tunnels_spliced += other.tunnels_spliced
            total.latency_counts = [a + b for a, b in zip(total.latency_counts, other.latency_counts, strict=True)]
            total.latency_sum += other.latency_sum
        return total

    def render(self, *, runs: int, audit_healthy: bool, tasks: int) -> str:
        lines = [
            "# HELP egressd_connections_total Client connections accepted, by kind.",
            "# TYPE egressd_connections_total counter",
        ]
        for kind, n in sorted(self.connections_total.items()):
            lines.append(f'egressd_connections_total{{kind="{kind}"}} {n}')
        lines += [
            "# HELP egressd_connections_open Client connections open now.",
            "# TYPE egressd_connections_open gauge",
            f"egressd_connections_open {self.connections_open}",
            "# HELP egressd_bytes_total Bytes relayed, by direction (up: to the destination).",
            "# TYPE egressd_bytes_total counter",
            f'egressd_bytes_total{{direction="up"}} {self.bytes_up}',
            f'egressd_bytes_total{{direction="down"}} {self.bytes_down}',
            "# HELP egressd_decisions_total Egress decisions, by decision and reason.",
            "# TYPE egressd_decisions_total counter",
        ]
        for (decision, reason), n in sorted(self.decisions.items()):
            lines.append(f'egressd_decisions_total{{decision="{decision}",reason="{reason}"}} {n}')
        lines += [
            "# HELP egressd_learned_total Attempts learn mode let through that the allowlist would have refused.",
            "# TYPE egressd_learned_total counter",
            f"egressd_learned_total {self.learned}",
            "# HELP egressd_tunnels_spliced_total Tunnels ended whose bytes moved in the kernel (splice) once checked.",
            "# TYPE egressd_tunnels_spliced_total counter",
            f"egressd_tunnels_spliced_total {self.tunnels_spliced}",
            "# HELP egressd_held_requests Requests held waiting for an approval now.",
            "# TYPE egressd_held_requests gauge",
            f"egressd_held_requests {self.held_requests}",
            "# HELP egressd_decision_seconds Time from request to decision.",
            "# TYPE egressd_decision_seconds histogram",
        ]
        cumulative = 0
        for bound, n in zip(LATENCY_BUCKETS, self.latency_counts, strict=False):
            cumulative += n
            lines.append(f'egressd_decision_seconds_bucket{{le="{bound}"}} {cumulative}')
        cumulative += self.latency_counts[-1]
        lines += [
            f'egressd_decision_seconds_bucket{{le="+Inf"}} {cumulative}',
            f"egressd_decision_seconds_sum {self.latency_sum:.6f}",
            f"egressd_decision_seconds_count {cumulative}",
            "# HELP egressd_runs Live runs.",
            "# TYPE egressd_runs gauge",
            f"egressd_runs {runs}",
            "# HELP egressd_audit_healthy 1 while the audit log can be written; 0 means egress is refused.",
            "# TYPE egressd_audit_healthy gauge",
            f"egressd_audit_healthy {int(audit_healthy)}",
            "# HELP egressd_tasks asyncio tasks alive in egressd's event loop now (a leak shows as growth).",
            "# TYPE egressd_tasks gauge",
            f"egressd_tasks {tasks}",
        ]
        return "\n".join(lines) + "\n"
