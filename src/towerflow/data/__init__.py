"""towerflow.data (under construction)."""
