"""towerflow.cluster (under construction)."""
