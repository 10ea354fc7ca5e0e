"""towerflow.checkpoint (under construction)."""
