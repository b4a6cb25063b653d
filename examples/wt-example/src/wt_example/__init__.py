"""Example wt backend `example_file`: tensors handed over through files in a shared directory."""
