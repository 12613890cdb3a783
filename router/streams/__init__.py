"""One generation's streams: dispatch to a decode node, the node client, the legs a generation
runs on, mid-stream migration, and the work that outlives a request."""
