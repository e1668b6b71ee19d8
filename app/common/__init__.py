"""Pieces every role uses: data, models, the flat state vector, metrics, checkpoints, evaluation, the loop."""
