"""`cpumoe prune`: inter-expert and intra-expert pruning of a MoE checkpoint."""
