"""Step ranges as users write them (`--steps 100:200`) and as messages show them (`1–3, 7`)."""

from __future__ import annotations

import re

from ..errors import UsageError


def parse_steps(spec: str | None) -> tuple[int | None, int | None]:
    """'A:B' -> (A, B), inclusive; either may be empty (None)."""
    if not spec:
        return None, None
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", spec)
    if not m:
        raise UsageError(f"--steps {spec!r} must look like START:STOP (either may be empty), e.g. 100:200")
    a, b = (int(x) if x else None for x in m.groups())
    if a is not None and b is not None and a > b:
        raise UsageError(f"--steps {spec!r}: START is after STOP")
    return a, b


def ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1–3, 7' (steps ascending)."""
    out: list[str] = []
    a: int | None = steps[0]
    for prev, cur in zip(steps, [*steps[1:], None]):
        if cur != prev + 1:
            out.append(f"{a}" if a == prev else f"{a}–{prev}")
            a = cur
    return ", ".join(out)
