"""The data plane (NIXL one-sided transfers, same-host shared memory) and the control channel."""
