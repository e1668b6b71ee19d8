"""The data a process trains or evaluates on: datasets, the image folder and its cache, loaders."""
