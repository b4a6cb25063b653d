"""wt applications: `wt_tools.demo`, `wt_tools.bench`, `wt_tools.tiny_model`."""
