"""The loop: what drives the trainer (train loop, fork, resume and replay, the checkpointer) and the run directory it drives (ledger, snapshots, retention, archive)."""
