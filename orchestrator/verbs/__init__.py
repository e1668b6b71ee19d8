"""The verbs: what each command a user types does, on the topology and the backends."""
