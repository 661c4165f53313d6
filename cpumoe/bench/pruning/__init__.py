"""`cpumoe bench prune`: the pruning sweep (ratios x methods): speed and quality against the unpruned model."""
