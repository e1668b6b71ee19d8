"""The topology: its typed model (`model`: the Topology, the rules between fields, reading a
file; `option_sections`: its train and ps sections, built on the app's options; `fields`:
the other sections; `values`: the kinds of value fields take; `messages`: a bad field as
one line) and the services it has (`services`). Nothing here reads a file but the topology
itself, or talks to an engine."""
