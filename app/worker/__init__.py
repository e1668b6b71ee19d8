"""A worker of a parameter-server job: the client that talks to the PS, the training loop, the process."""
