"""The floor rl/ stands on: snapshot manifests, safe loading, seeding, fingerprints, topology and resharding."""
