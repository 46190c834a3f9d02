"""What the tests that play chaos scenarios share."""

from __future__ import annotations

from elastic_ext.chaos.runner import RunResult


def explain(result: RunResult, tail: int = 4000) -> str:
    """A failed scenario told for the assertion message: violations, then each log's end."""
    lines = [f"scenario {result.scenario.name}:"]
    if result.verdict is not None:
        lines += [f"  - {v}" for v in result.verdict.violations]
    for name, log in result.logs.items():
        text = log.read_text(errors="replace") if log.exists() else ""
        lines.append(f"===== {name} ({log}) =====\n{text[-tail:]}")
    return "\n".join(lines)
