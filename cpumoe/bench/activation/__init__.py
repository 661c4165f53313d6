"""`cpumoe bench experts`: which experts a prompt set routes to, per layer; heatmaps and load imbalance."""
