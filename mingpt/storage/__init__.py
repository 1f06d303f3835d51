"""Files and snapshots: `files` is the one door to local paths and fsspec URLs; `snapshot` is what a
snapshot is (no parallelism); the stores, background saves and the Checkpointer build on both."""
