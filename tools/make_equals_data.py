"""Write examples/data/equals_{train,eval}.jsonl: questions a+b-c= (a, b, c two-digit numbers) whose
answer is one digit, 1,000 to train on and 32 held out, all different, from a fixed seed (so running it
again writes the same files). examples/multiturn_calculator.yaml trains on them with builtin:equals."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "examples" / "data"


def questions(n: int, seed: int = 36) -> list[dict]:
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n:
        a, b, r = rng.randint(10, 99), rng.randint(10, 99), rng.randint(0, 9)
        c = a + b - r
        q = f"{a}+{b}-{c}="
        if 10 <= c <= 99 and q not in seen:
            seen.add(q)
            rows.append({"prompt": q, "answer": str(r)})
    return rows


def main() -> None:
    rows = questions(1032)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, part in (("equals_train.jsonl", rows[:1000]), ("equals_eval.jsonl", rows[1000:])):
        (OUT / name).write_text("".join(json.dumps(x) + "\n" for x in part))


if __name__ == "__main__":
    main()
