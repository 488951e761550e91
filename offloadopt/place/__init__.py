"""Where each param's state lives: the pure policy, one record per param, the budget, the
cost model and ``offload_fraction="auto"``."""
