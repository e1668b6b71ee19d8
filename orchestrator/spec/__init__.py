"""What a run is: the typed topology, its services, the values shared with the app."""
