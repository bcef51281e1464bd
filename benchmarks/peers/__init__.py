"""bench_peers' parts: the model and loop pieces every tool shares (common), each tool through
its own real code (tools), the fault matrix (faults), and the two measurements (cost, coverage)."""
