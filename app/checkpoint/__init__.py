"""Checkpoints: the files, the resume decision, the writer."""
