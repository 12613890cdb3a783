"""KV block transport: interface, backends, wire layout, per-transfer state machine (issue 3)."""
