"""Post-mortem: inspection, verify, materialize (replay to a step, export, fork), plots."""
