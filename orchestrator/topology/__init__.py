"""The topology: its typed model (`model`: the Topology, its train and ps sections, the
rules between fields, reading a file; `fields`: the other sections; `values`: the kinds
of value fields take; `messages`: a bad field as one line), the services it has
(`services`), and the typing stub of the option-built sections (`stub`). Nothing here
reads a file but the topology itself, or talks to an engine."""
