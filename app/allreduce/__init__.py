"""The allreduce strategy (DDP): no PS, the workers average their gradients."""
