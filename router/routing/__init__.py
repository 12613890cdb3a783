"""Where a request goes: the node directory, the prefix mirror, the routing policies and
their cost terms, the P/D pairing filter, and the decision log."""
