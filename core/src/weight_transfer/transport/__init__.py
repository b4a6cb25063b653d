"""Helpers shared by backends: stateless groups, packing layout, dtype codec, wire version."""
