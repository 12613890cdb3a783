"""The models: the family registry (architecture name -> config adapter, module, weight
map, sharding plan, parameter counts; one file per family, the dense one in llama.py), the
config read from config.json, the checkpoint loader, the tensor-parallel sharding rules, and
the bundled model's conversion."""
