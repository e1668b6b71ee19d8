"""What every trainer shares: the loop, evaluation, the flat model, metrics, models, plugins."""
