"""towerflow.ps (under construction)."""
