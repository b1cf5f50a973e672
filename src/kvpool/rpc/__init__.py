"""The control plane: request/reply channels to the master (ZMQ, and plain TCP beside it), their
frames, credentials and socket timeouts. Nothing here moves object bytes (that is kvpool.transfer)."""
