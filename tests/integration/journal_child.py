"""Child process for journal crash/concurrency tests: `python journal_child.py PATH MODE [N]`.

write: append steps after the last committed one, forever (or N), printing each committed step.
hold:  open the writer, print "ready", sleep.
follow: read-only; poll until step N is visible, checking each new record decodes in order.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from journal_helpers import step_events  # noqa: E402
from verlj.journal import Journal  # noqa: E402

path, mode = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else None

if mode == "write":
    with Journal.open_writer(path, map_size=1 << 20) as j:
        step = j.last_step() + 1
        while n is None or step <= n:
            j.writer.append_step(step, step_events(step, samples=8, tokens=64))
            print(step, flush=True)
            step += 1
elif mode == "hold":
    with Journal.open_writer(path):
        print("ready", flush=True)
        time.sleep(60)
elif mode == "follow":
    while True:
        try:
            j = Journal.open_reader(path)
            break
        except Exception:
            time.sleep(0.01)
    seen = 0
    deadline = time.time() + 60
    while seen < n and time.time() < deadline:
        for rec in j.iter_steps(seen + 1):
            assert rec.step == seen + 1, (rec.step, seen)
            seen = rec.step
        time.sleep(0.005)
    print(f"followed {seen}", flush=True)
