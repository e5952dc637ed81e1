"""The state layer: snapshots and their manifests, safe loading, checkpoint policy, seeding, fingerprints,
the run ledger (the only reader and writer of run metadata in the journal), recovery and replay."""
