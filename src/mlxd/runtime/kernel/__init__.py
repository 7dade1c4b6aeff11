"""The runtime's kernel: bounded channels and replies, the one MLX thread, the messages between actors."""
