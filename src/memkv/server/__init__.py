"""The MemKV node: value store (store), connection handling (node), admin HTTP (admin), metrics."""
