"""The model: its config read from config.json, the module, the checkpoint loader, the tensor-
parallel sharding rules, and the bundled model's conversion."""
