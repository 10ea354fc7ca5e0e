"""towerflow.models (under construction)."""
