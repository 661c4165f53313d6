"""`cpumoe bench sweep`: the MoE-Inference-Bench sweeps, resumable, optionally spread over Ray."""
