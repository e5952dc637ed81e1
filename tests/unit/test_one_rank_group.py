"""A plain process's one-rank group (engine.dist.setup): the free port it picked can be taken by another process before
its store binds it (many runs start at once on a CI machine); it picks another instead of failing the run."""

import subprocess
import sys

SCRIPT = """
import os, socket
from verlj.engine import dist
from verlj.engine.config import make_config

held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
taken = held.getsockname()[1]
ports = [taken]
real = dist._free_port
dist._free_port = lambda: ports.pop(0) if ports else real()  # the first pick is a port another process holds
rt = dist.setup(make_config(None, []))
import torch.distributed as td
print(td.is_initialized(), rt.world_size, int(os.environ["MASTER_PORT"]) != taken)
"""


def test_a_taken_port_is_picked_again():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["True", "1", "True"], out.stdout
