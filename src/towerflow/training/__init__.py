"""towerflow.training (under construction)."""
