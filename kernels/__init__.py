"""Hand-written Triton GEMMs (W8A8, W8A16) with static per-phase configs."""
