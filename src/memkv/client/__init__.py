"""The MemKV client: HRW placement (hrw), one node's pool and health (node), the cluster (cluster)."""
