"""`verlj view`: the journal in a browser, read-only, live while the runs train.

    verlj view RUN                          # http://127.0.0.1:8765/ : the run, its curves, any step
    verlj view RUN_A RUN_B --port 8800      # /compare: the curves overlaid, the first divergent step
    verlj view RUN --host 0.0.0.0 --token SECRET   # beyond this machine: only with a token

The server (http.py: the standard library's ThreadingHTTPServer) answers GET only; what it
shows (answers.py) is what the post-mortem readers answer: inspection's summary and step detail, metrics'
rows and find, diff; rollouts' sample columns; verify's report. The page (static/: one HTML shell, one
script, one stylesheet, shipped with the package) draws itself from that JSON: no front-end build,
nothing fetched from the internet.
"""

from .http import Server, serve

__all__ = ["Server", "serve"]
